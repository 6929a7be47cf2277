#!/usr/bin/env bash
# The merged decode step, same run: d7e4358 (one GPU batch at a time) then 6f206ab (merged),
# on the 1 x 16 policy of the bcacd53 compare run (policy-1x16.json). Run alone.
# (The log here was written by an earlier form of this script: "merged" first, then "before".)
here=$(cd "$(dirname "$0")" && pwd)
exec "$here/../ab_pair.sh" d7e4358 6f206ab "$here/policy-1x16.json" "$here/ab_prompt64.log"
