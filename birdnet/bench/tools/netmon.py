"""What TCP does on the benchmark's links, sampled from outside while `birdnet bench allreduce
--netns --vs-gloo` runs (docs/benchmarks.md, "Dense all-reduce against Gloo").

    python -m birdnet.bench.tools.netmon record RAW.jsonl &      # every 1 s, until killed
    birdnet bench allreduce --nodes 8 --sizes 11689512 --codecs none --netns --rate 100mbit ...
    kill %1
    python -m birdnet.bench.tools.netmon summary RAW.jsonl > netmon_SUMMARY.json

`record` writes, per second: for each node namespace of the running benchmark (bn<pid>-<i>), its
token bucket's counters (bytes and packets sent, dropped, overlimits) and its TCP retransmissions;
`ss -tin` of node 0; and whether the Gloo ranks are running (birdnet runs first, then Gloo).
`summary` keeps, for node 0's sending connection (the one that sent over 50 MB), BBR's bandwidth
estimate, pacing gain, congestion window, RTT and unsent queued bytes per sample, and the totals per phase.
A throwaway-grade tool: it runs `ip`, `tc` and `ss` as root and is not part of birdnet.
"""
import json
import re
import statistics
import subprocess
import sys
import time


def record(path):
    with open(path, "w") as out:
        while True:
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
            names = sorted(w.split()[0] for w in listed if re.match(r"bn\d+-\d+$", w.split()[0] if w.split() else ""))
            rec = {"t": time.time(), "gloo": subprocess.run(["pgrep", "-f", "gloo_worker"], capture_output=True).returncode == 0,
                   "ns": {}}
            for ns in names:
                q = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
                m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)", q)
                snmp = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"], capture_output=True, text=True).stdout
                tcp = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")]
                d = dict(zip(tcp[0][1:], map(int, tcp[1][1:]))) if len(tcp) == 2 else {}
                rec["ns"][ns] = [int(x) for x in m.groups()] + [d.get("RetransSegs", -1), d.get("OutSegs", -1)] if m else None
            if names:
                rec["ss0"] = subprocess.run(["ip", "netns", "exec", names[0], "ss", "-tin"], capture_output=True, text=True).stdout
            out.write(json.dumps(rec) + "\n")
            out.flush()
            time.sleep(1.0)


def summary(path):
    recs = [json.loads(line) for line in open(path)]
    recs = [r for r in recs if r["ns"]]
    first_gloo = next(i for i, r in enumerate(recs) if r["gloo"])
    bounds = {"birdnet": (recs[0], recs[first_gloo - 1]), "gloo": (recs[first_gloo - 1], recs[-1])}
    fields = ["tbf_bytes", "tbf_packets", "tbf_dropped", "tbf_overlimits", "tbf_requeues", "tcp_retrans_segs", "tcp_out_segs"]
    res = {"file": path, "phases": {}}
    for phase, (a, b) in bounds.items():
        tot = {f: sum(v[i] for v in b["ns"].values() if v) - sum(v[i] for v in a["ns"].values() if v)
               for i, f in enumerate(fields)}
        samples = []
        for r in recs:
            if (phase == "gloo") != r["gloo"]:
                continue
            for block in r.get("ss0", "").split("\nESTAB"):
                m = re.search(r"bytes_sent:(\d+)", block)
                bw = re.search(r"bbr:\(bw:(\d+)bps", block)
                if not m or int(m.group(1)) < 50_000_000:
                    continue
                gain = re.search(r"pacing_gain:([\d.]+)", block)
                samples.append({"bbr_bw_mbit": round(int(bw.group(1)) / 1e6, 1) if bw else None,
                                "pacing_gain": float(gain.group(1)) if gain else None,
                                "cwnd": int(re.search(r"cwnd:(\d+)", block).group(1)),
                                "rtt_ms": float(re.search(r" rtt:([\d.]+)", block).group(1)),
                                # bytes the application had queued that TCP had not sent yet
                                "notsent_bytes": int(ns.group(1)) if (ns := re.search(r"notsent:(\d+)", block)) else 0})
        bbr = samples and all(s["bbr_bw_mbit"] is not None for s in samples)
        res["phases"][phase] = {
            "totals_all_nodes": tot, "samples": samples,
            "bw_estimate_over_1gbit": sum((s["bbr_bw_mbit"] or 0) > 1000 for s in samples),
            "median_bw_mbit": statistics.median(s["bbr_bw_mbit"] for s in samples) if bbr else None,
            "median_cwnd": statistics.median(s["cwnd"] for s in samples) if samples else None,
            "median_rtt_ms": statistics.median(s["rtt_ms"] for s in samples) if samples else None,
            "notsent_quartiles_bytes": statistics.quantiles([s["notsent_bytes"] for s in samples], n=4)
            if len(samples) > 1 else None}
    json.dump(res, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    {"record": record, "summary": summary}[sys.argv[1]](sys.argv[2])
