"""How much more of a scenario's prompts a trie of prompts would share than the one common
prefix the engine shares (issue 47: the work left to skip), counted in characters of the
prompts HELM sent (a scenario_state.json of a comparison's helm_output).

With the common prefix shared, the prompts' characters computed are the prefix once and every
prompt's rest; with a trie, each distinct beginning once: the prefix, then one node per
distinct longer beginning.

    python runs/helm_vs_hf/suffix_trie.py <scenario_state.json> [...]
"""

import json
import os
import sys


def main() -> None:
    for path in sys.argv[1:]:
        prompts = [s["request"]["prompt"] for s in json.load(open(path))["request_states"]]
        prefix = len(os.path.commonprefix(prompts))
        by_prefix = prefix + sum(len(p) - prefix for p in prompts)
        beginnings = {p[:i] for p in prompts for i in range(prefix + 1, len(p) + 1)}
        by_trie = prefix + len(beginnings)
        print(f"{path}: {len(prompts)} prompts, {sum(map(len, prompts)):,} characters; the common prefix "
              f"{prefix}; computed with it shared {by_prefix:,}, as a trie {by_trie:,} "
              f"({1 - by_trie / by_prefix:.1%} fewer)")


if __name__ == "__main__":
    main()
