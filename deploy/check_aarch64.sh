#!/usr/bin/env bash
# Run birdnet on aarch64 (arm64) under user-mode emulation, on an x86_64 machine.
#
# Builds (or reuses, from the cache) an arm64 Debian root file system, a venv inside it with the
# birdnet wheel built from this checkout and its dependencies as PyPI's aarch64 wheels, copies the
# tests it needs (they are not in the wheel) and runs there:
#   birdnetd --help; birdnet demo --nodes 2 --epochs 1 --codec dense --hidden 128,128 --network loopback;
#   tests/test_kernels_reference.py tests/test_signbits.py tests/test_codecs_roundtrip.py
# With --mixed-ring it then runs deploy/aarch64/mixed_ring.py: a 3-node ring whose middle node
# (rank 1) is an emulated aarch64 daemon with its own emulated training process.
#
#   bash deploy/check_aarch64.sh                    # everything but the mixed ring
#   bash deploy/check_aarch64.sh --mixed-ring       # and the mixed x86_64 + aarch64 ring
#   bash deploy/check_aarch64.sh --only-mixed-ring  # the ring alone (no demo, no tests)
#   bash deploy/check_aarch64.sh --cache DIR --suite bookworm --cpu cortex-a72 --runner proot
#
# How guest programs run. A Linux kernel runs an arm64 ELF only through a binfmt_misc handler.
# Containers often have binfmt_misc unmounted or cannot register one, so:
#   --runner binfmt  chroot (in a private mount namespace) where a qemu-aarch64 handler is registered
#   --runner proot   proot -q qemu-aarch64-static: proot catches every execve and starts the guest
#                    program under the emulator, so processes that spawn processes work (the demo,
#                    the daemons, multiprocessing's spawn) without any handler
#   --runner auto    (default) binfmt if a handler is registered and enabled, else proot
# (Running the emulator directly, qemu-aarch64-static -L ROOTFS python3, works for one process only:
# its children are exec'd by the kernel, which then cannot run them. The demo needs children.)
#
# Cache (default /var/cache/birdnet-aarch64, or --cache DIR), reused between runs:
#   rootfs-SUITE-arm64/     the root file system (mmdebstrap --variant=extract: packages unpacked on
#                           the host, no maintainer script runs, so no emulation is needed to build it)
#   rootfs-.../opt/birdnet-venv   the venv, made once (ensurepip under emulation: ~1-2 min)
#   wheels/                 aarch64 wheels downloaded on the host with pip download --platform
#   numba-cache/            NUMBA_CACHE_DIR: a second run does not compile the kernels again
# --fresh removes the cache's venv and Numba cache first (the root file system and wheels stay).
#
# Needs root (mmdebstrap writes root-owned files; chroot), apt-get on a Debian-like host to install
# qemu-user-static, mmdebstrap and proot when missing, and the network to Debian's archive and PyPI.
# Exit status: 0 when every step passed, 1 when one failed, 2 on bad usage or missing tools.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"

cache="/var/cache/birdnet-aarch64"
suite="bookworm"
mirror="http://deb.debian.org/debian"
runner="auto"
cpu="cortex-a72"        # Raspberry Pi 4's core: ARMv8.0-A with NEON, no SVE (qemu's "max" has SVE)
python_host="${PYTHON:-python3}"
fresh=0
do_checks=1
do_mixed=0
mixed_args=()
test_timeout=1800       # per test under emulation (pytest-timeout); the first compile is the slow part

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --cache) cache="$2"; shift 2 ;;
    --suite) suite="$2"; shift 2 ;;
    --mirror) mirror="$2"; shift 2 ;;
    --runner) runner="$2"; shift 2 ;;
    --cpu) cpu="$2"; shift 2 ;;
    --python) python_host="$2"; shift 2 ;;
    --fresh) fresh=1; shift ;;
    --mixed-ring) do_mixed=1; shift ;;
    --only-mixed-ring) do_mixed=1; do_checks=0; shift ;;
    --mixed-arg) mixed_args+=("$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check_aarch64: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$runner" in auto|binfmt|proot) ;; *) echo "check_aarch64: --runner must be auto, binfmt or proot, not $runner" >&2; exit 2 ;; esac

rootfs="$cache/rootfs-$suite-arm64"
wheels="$cache/wheels"
numba_cache="$cache/numba-cache"   # NUMBA_CACHE_DIR of every guest process
venv=/opt/birdnet-venv           # inside the rootfs
gtests=/opt/birdnet-tests        # inside the rootfs
log_dir="$cache/logs/$(date -u +%Y%m%dT%H%M%SZ)"
# packages for the root file system: Python with venv, a shell and coreutils for the demo's and
# pytest's subprocesses, libc-bin for ldconfig, libstdc++ for numpy's and scipy's wheels, libgomp
packages="python3,python3-venv,dash,coreutils,libc-bin,libstdc++6,libgomp1"

say() { printf '[check_aarch64 %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { say "ERROR: $*" >&2; exit 2; }

# -- tools -------------------------------------------------------------------------------------
need_tools() {
  local missing=()
  command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  command -v proot >/dev/null || missing+=(proot)
  command -v unshare >/dev/null || missing+=(util-linux)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then die "missing ${missing[*]}: install them (Debian: apt-get install ${missing[*]})"; fi
    say "installing ${missing[*]} from the Debian archive"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  [ "$(id -u)" = 0 ] || die "run as root (mmdebstrap and chroot need it)"
  "$python_host" -c 'import sys; assert sys.version_info >= (3, 10)' || die "--python $python_host: need Python 3.10+"
}

# binfmt: a registered, enabled qemu-aarch64 handler; prints its interpreter path
binfmt_interpreter() {
  local f
  for f in /proc/sys/fs/binfmt_misc/qemu-aarch64 /proc/sys/fs/binfmt_misc/aarch64; do
    if [ -r "$f" ] && head -1 "$f" | grep -q '^enabled'; then
      sed -n 's/^interpreter //p' "$f"; return 0
    fi
  done
  return 1
}

pick_runner() {
  if [ "$runner" = auto ]; then
    if binfmt_interpreter >/dev/null; then runner=binfmt; else runner=proot; fi
  fi
  if [ "$runner" = binfmt ]; then
    local interp
    interp="$(binfmt_interpreter)" || die "--runner binfmt: no enabled qemu-aarch64 handler in /proc/sys/fs/binfmt_misc (mounted: $(mount | grep -c binfmt_misc)); use --runner proot"
    # without the F flag the kernel opens the interpreter inside the chroot: copy it in
    mkdir -p "$rootfs$(dirname "$interp")"
    cp -f "$(command -v qemu-aarch64-static)" "$rootfs$interp"
    say "runner: chroot through the binfmt_misc handler ($interp)"
  else
    if [ -d /proc/sys/fs/binfmt_misc ] && ! mount | grep -q binfmt_misc; then
      say "runner: proot -q qemu-aarch64-static (binfmt_misc is not mounted here)"
    else
      say "runner: proot -q qemu-aarch64-static (no enabled qemu-aarch64 binfmt handler)"
    fi
  fi
}

# guest CMD...: run CMD inside the arm64 root (cwd /, a clean environment), at nice 10: the
# emulator uses a whole core and this machine's cores are shared.
# Host directories are seen inside at the SAME paths (/tmp, the wheels, the Numba cache, /dev with
# /dev/shm): proot 5.1 does not translate the paths of faccessat2, which qemu 7.2 uses for the
# guest's access(), so os.access() inside checks the host's path; with equal paths it is right
# (the client's os.access check of its daemon's socket failed otherwise).
# shellcheck disable=SC2317  # called indirectly, through step
guest() {
  local envs=(env -i PATH="$venv/bin:/usr/bin:/bin" HOME=/root LANG=C.UTF-8 TMPDIR=/tmp
              NUMBA_CACHE_DIR="$numba_cache" QEMU_CPU="$cpu")
  if [ "$runner" = binfmt ]; then
    # shellcheck disable=SC2016  # the script is for sh, its $1 and $@ are sh's
    QEMU_CPU="$cpu" nice -n 10 unshare --mount --propagation private -- sh -c '
      r="$1"; shift
      mount --bind /dev "$r/dev" && mount -t proc proc "$r/proc" && mount --bind /sys "$r/sys" &&
      mount --bind /tmp "$r/tmp" && mkdir -p "$r$0" && mount --bind "$0" "$r$0" && exec chroot "$r" "$@"' \
      "$cache" "$rootfs" "${envs[@]}" "$@"
  else
    QEMU_CPU="$cpu" nice -n 10 proot -q qemu-aarch64-static -r "$rootfs" -b /dev -b /proc -b /sys -b /tmp \
      -b "$cache" -w / "${envs[@]}" "$@"
  fi
}

# -- the root file system, the wheels, the venv ---------------------------------------------------
build_rootfs() {
  if [ -f "$rootfs/.birdnet-rootfs" ] && [ "$(cat "$rootfs/.birdnet-rootfs")" = "$packages" ]; then
    say "rootfs: reusing $rootfs"; return
  fi
  say "rootfs: mmdebstrap --arch=arm64 --variant=extract $suite ($packages)"
  rm -rf "$rootfs.tmp"
  local t0=$SECONDS
  mmdebstrap --quiet --arch=arm64 --variant=extract --include="$packages" "$suite" "$rootfs.tmp" "$mirror" \
    > "$log_dir/mmdebstrap.log" 2>&1 || { tail -20 "$log_dir/mmdebstrap.log"; die "mmdebstrap failed (log: $log_dir/mmdebstrap.log)"; }
  mkdir -p "$rootfs.tmp"/{proc,sys,dev,root,opt}
  chmod 1777 "$rootfs.tmp/tmp"
  echo "$packages" > "$rootfs.tmp/.birdnet-rootfs"
  if [ -d "$rootfs" ]; then
    # the package list changed: lay the new packages over the old root, keeping its venv and Numba
    # cache (the venv takes minutes to make under emulation)
    cp -a "$rootfs.tmp"/. "$rootfs"/ && rm -rf "$rootfs.tmp"
  else
    mv "$rootfs.tmp" "$rootfs"
  fi
  say "rootfs: built in $((SECONDS - t0)) s, $(du -sh "$rootfs" | cut -f1)"
}

# pins: the versions of the compiled dependencies installed beside the host Python (the x86_64
# side of a mixed ring), so both architectures run the same numpy, numba and llvmlite
host_pins() {
  "$python_host" - <<'EOF'
from importlib import metadata
for p in ("numpy", "numba", "llvmlite", "pyzmq", "msgpack", "scikit-learn", "scipy"):
    try:
        print(f"{p}=={metadata.version(p)}")
    except metadata.PackageNotFoundError:
        print(p)
EOF
}

pyver=""
fetch_wheels() {
  local t0=$SECONDS
  mkdir -p "$wheels" "$log_dir/dist"
  say "wheel: building birdnet from $repo"
  (cd "$repo" && "$python_host" -m pip wheel -q --no-deps -w "$log_dir/dist" . ) > "$log_dir/wheel.log" 2>&1 \
    || { tail -20 "$log_dir/wheel.log"; die "pip wheel failed"; }
  bnwheel="$(ls "$log_dir"/dist/birdnet-*.whl)"
  cp -f "$bnwheel" "$wheels/"
  bnwheel="$wheels/$(basename "$bnwheel")"
  local exe
  for exe in "$rootfs"/usr/bin/python3.[0-9]*; do
    case "$exe" in *[0-9]) pyver="${exe##*/python}"; break ;; esac
  done
  mapfile -t pins < <(host_pins)
  say "wheels: pip download for aarch64, CPython $pyver (${pins[*]})"
  "$python_host" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 --python-version "$pyver" \
    --implementation cp -d "$wheels" "$bnwheel" "${pins[@]}" pytest pytest-timeout \
    > "$log_dir/download.log" 2>&1 || { tail -20 "$log_dir/download.log"; die "pip download failed"; }
  printf '%s\n' "${pins[@]}" pytest pytest-timeout > "$wheels/requirements.txt"
  local n=("$wheels"/*.whl)
  say "wheels: ${#n[@]} in $wheels ($(du -sh "$wheels" | cut -f1)), $((SECONDS - t0)) s"
}

# keep_mtimes save|restore: a reinstalled file whose content is unchanged gets its old mtime back,
# so Numba's cache of the kernels in it (keyed on the source's mtime and size) stays valid
keep_mtimes() {
  "$python_host" - "$1" "$rootfs$venv/lib/python$pyver/site-packages/birdnet" "$rootfs$venv/.birdnet-mtimes.json" <<'EOF'
import hashlib, json, os, sys
how, top, db = sys.argv[1:]
files = {}
for d, _, names in os.walk(top):
    for n in names:
        if n.endswith(".py"):
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                files[os.path.relpath(p, top)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mtime_ns)
if how == "save":
    with open(db, "w") as f:
        json.dump(files, f)
elif os.path.exists(db):
    with open(db) as f:
        old = json.load(f)
    for rel, (digest, _) in files.items():
        if rel in old and old[rel][0] == digest:
            os.utime(os.path.join(top, rel), ns=(old[rel][1], old[rel][1]))
EOF
}

make_venv() {
  local t0=$SECONDS
  if [ "$fresh" = 1 ]; then rm -rf "$rootfs$venv" "$numba_cache"; fi
  mkdir -p "$numba_cache"
  if [ ! -x "$rootfs$venv/bin/python" ]; then
    say "venv: python3 -m venv $venv (emulated ensurepip)"
    guest /usr/bin/python3 -m venv "$venv" > "$log_dir/venv.log" 2>&1 \
      || { tail -20 "$log_dir/venv.log"; die "venv failed"; }
  fi
  say "venv: pip install --no-index from $wheels"
  # --no-compile: byte-compiling scipy and scikit-learn under emulation takes many minutes; the host's
  # Python does it below when it is the same minor version (same bytecode), else the guest writes
  # each .pyc at its first import
  # pip itself takes minutes under emulation, even with nothing to do: only when the pins changed
  if ! cmp -s "$wheels/requirements.txt" "$rootfs$venv/.birdnet-requirements.txt"; then
    guest "$venv/bin/pip" install -q --no-compile --disable-pip-version-check --no-index --find-links "$wheels" \
      -r "$wheels/requirements.txt" > "$log_dir/pip.log" 2>&1 || { tail -20 "$log_dir/pip.log"; die "pip install failed"; }
    cp "$wheels/requirements.txt" "$rootfs$venv/.birdnet-requirements.txt"
  fi
  # birdnet itself only when the wheel changed: a reinstall gives its kernels' source files new
  # mtimes, and Numba's cache (keyed on them) would compile every kernel again, minutes under qemu
  local sum
  # of the files' names and contents, not of the zip (whose entries carry the files' mtimes)
  sum="$("$python_host" -c 'import hashlib, sys, zipfile
z, h = zipfile.ZipFile(sys.argv[1]), hashlib.sha256()
for n in sorted(z.namelist()):
    h.update(n.encode() + b"\0" + z.read(n))
print(h.hexdigest())' "$bnwheel")"
  if [ "$(cat "$rootfs$venv/.birdnet-wheel.sha256" 2>/dev/null)" != "$sum" ]; then
    keep_mtimes save
    guest "$venv/bin/pip" install -q --no-compile --disable-pip-version-check --no-index --find-links "$wheels" \
      --force-reinstall --no-deps "$bnwheel" >> "$log_dir/pip.log" 2>&1 || { tail -20 "$log_dir/pip.log"; die "pip install birdnet failed"; }
    keep_mtimes restore
    echo "$sum" > "$rootfs$venv/.birdnet-wheel.sha256"
  else
    say "venv: birdnet wheel unchanged (sha256 ${sum:0:12}), kept with its compiled kernels"
  fi
  local site="$rootfs$venv/lib/python$pyver/site-packages"
  if [ "$("$python_host" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$pyver" ] && [ -d "$site" ]; then
    nice -n 10 "$python_host" -m compileall -q -j 2 -s "$rootfs" -p / "$site" > "$log_dir/compileall.log" 2>&1 || true
  fi
  say "venv: ready in $((SECONDS - t0)) s"
}

copy_tests() {
  rm -rf "$rootfs$gtests"
  mkdir -p "$rootfs$gtests/tests"
  cp "$repo"/tests/{conftest.py,_codec_sim.py,_kernel_refs.py,test_kernels_reference.py,test_signbits.py,test_codecs_roundtrip.py} "$rootfs$gtests/tests/"
  # pytest's rootdir and its settings (timeout, markers) from the project's pyproject.toml
  cp "$repo/pyproject.toml" "$rootfs$gtests/"
}

# -- the checks --------------------------------------------------------------------------------
results=()
failed=0
step() {  # step NAME CMD...: run CMD in the guest, log it, time it
  local name="$1"; shift
  local t0=$SECONDS rc=0 logf
  logf="$log_dir/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_').log"
  say "run: $name"
  guest "$@" > "$logf" 2>&1 || rc=$?
  local dt=$((SECONDS - t0))
  if [ "$rc" = 0 ]; then results+=("ok    ${dt}s  $name"); else results+=("FAIL  ${dt}s  $name (exit $rc, log $logf)"); failed=1; tail -30 "$logf"; fi
  tail -3 "$logf" | sed 's/^/    /'
}

run_checks() {
  # shellcheck disable=SC2016  # expanded by the guest's sh
  step "uname -m" /bin/sh -c 'uname -m; test "$(uname -m)" = aarch64'
  step "python platform" "$venv/bin/python" -c 'import platform, numpy, numba, llvmlite, zmq; print(platform.machine(), "numpy", numpy.__version__, "numba", numba.__version__, "llvm cpu", __import__("llvmlite.binding", fromlist=["x"]).get_host_cpu_name()); assert platform.machine() == "aarch64"'
  step "birdnetd --help" "$venv/bin/birdnetd" --help
  # dense on a small MLP: the check is that daemons and spawned workers run; the kernels get tests of their own
  step "birdnet demo (dense)" /bin/sh -c "cd /tmp && $venv/bin/birdnet demo --nodes 2 --epochs 1 --codec dense --hidden 128,128 --network loopback"
  step "pytest kernels, signbits, codec round trips" /bin/sh -c \
    "cd $gtests && $venv/bin/python -m pytest -q -p no:cacheprovider --timeout $test_timeout tests/test_kernels_reference.py tests/test_signbits.py tests/test_codecs_roundtrip.py"
}

run_mixed() {
  local t0=$SECONDS rc=0 logf="$log_dir/mixed_ring.log"
  say "run: mixed ring (deploy/aarch64/mixed_ring.py)"
  local gcmd
  if [ "$runner" = binfmt ]; then gcmd="binfmt"; else gcmd="proot"; fi
  "$python_host" "$here/aarch64/mixed_ring.py" --rootfs "$rootfs" --runner "$gcmd" --cpu "$cpu" \
    --venv "$venv" --share "$cache" --numba-cache "$numba_cache" --out "$log_dir/mixed" "${mixed_args[@]}" 2>&1 | tee "$logf" || rc=$?
  local dt=$((SECONDS - t0))
  if [ "$rc" = 0 ]; then results+=("ok    ${dt}s  mixed ring"); else results+=("FAIL  ${dt}s  mixed ring (exit $rc, log $logf)"); failed=1; fi
}

main() {
  local t0=$SECONDS
  mkdir -p "$cache" "$log_dir"
  need_tools
  # the mixed ring's x86_64 daemons run from the host's birdnet: say so now, not after the checks
  if [ "$do_mixed" = 1 ] && ! "$python_host" -c 'import birdnet.daemon' >/dev/null 2>&1; then
    die "--mixed-ring runs the x86_64 nodes with $python_host, which cannot import birdnet; activate a venv with birdnet installed (pip install -e .) or set PYTHON=/path/to/that/python"
  fi
  build_rootfs
  pick_runner
  fetch_wheels
  make_venv
  copy_tests
  if [ "$do_checks" = 1 ]; then run_checks; fi
  if [ "$do_mixed" = 1 ]; then run_mixed; fi
  echo
  say "summary (emulated aarch64, qemu $(qemu-aarch64-static --version | head -1 | awk '{print $3}'), cpu $cpu, runner $runner; logs $log_dir):"
  printf '  %s\n' "${results[@]}"
  say "total $((SECONDS - t0)) s"
  exit "$failed"
}

main
