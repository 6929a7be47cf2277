#!/usr/bin/env bash
# A merged decode step's cache loads, same run: dad58fe (batch after batch) then 7a4955c (the
# batches' reads in flight together), on the 1 x 16 policy of the bcacd53 compare run. Run alone.
here=$(cd "$(dirname "$0")" && pwd)
exec "$here/../ab_pair.sh" dad58fe 7a4955c "$here/../merged-decode/policy-1x16.json" "$here/ab_prompt64.log"
