import os
import sys

# Tests spawn daemon and worker processes; make sure they import this checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
