# The engine at two commits, one after the other, three rounds: a decode step's host time per
# layer (host_per_layer.py). Run alone, from the repository root:
#   git worktree add -f /tmp/bA BASE && bash runs/bench/decode_host_overhead/ab.sh > OUT.txt
HERE=$(cd "$(dirname "$0")" && pwd)
echo "host: $(lscpu | grep 'Model name' | sed 's/.*: *//'), $(nproc) cores; load $(cat /proc/loadavg)"
echo "base: $(git -C /tmp/bA log --oneline -1 | cut -c1-60); new: $(git log --oneline -1 | cut -c1-60) + working tree"
for round in 1 2 3; do
  echo "round $round"
  echo "  base $(cd /tmp && PYTHONPATH=/tmp/bA python "$HERE/host_per_layer.py" 2>/dev/null | tr '\n' ' ')"
  echo "  new  $(cd /tmp && python "$HERE/host_per_layer.py" 2>/dev/null | tr '\n' ' ')"
done
echo "load after: $(cat /proc/loadavg)"
