"""`flexgen-helm verify`: check converted weight stores against their manifests' checksums."""

from __future__ import annotations

from flexgen_helm.errors import WeightStoreError


def add_command(sub) -> None:
    c = sub.add_parser("verify", help="check weight stores byte for byte (sizes and sha256 of every tensor)")
    c.add_argument("stores", nargs="*", help="store directories (default: every store in the cache, "
                                             "$FLEXGEN_HELM_CACHE/stores)")
    c.set_defaults(func=run)


def run(args) -> int:
    from flexgen_helm.weights.verify import cached_stores, record_missing_crc32s, store_problems

    stores = args.stores or cached_stores()
    if not stores:
        raise WeightStoreError("no stores given and none in the cache: nothing to verify")
    bad = 0
    for store in stores:
        problems = store_problems(store)
        for line in problems:
            print(f"BAD  {line}")
        if not problems:
            print(f"ok   {store}{_crc32s_recorded(store, record_missing_crc32s)}")
        bad += bool(problems)
    if bad:
        print(f"{bad} of {len(stores)} stores damaged: the next run that loads one rewrites what is damaged "
              "(or run `flexgen-helm convert --verify` for it)")
    return 1 if bad else 0


def _crc32s_recorded(store, record) -> str:
    """What recording an intact old store's CRC-32s did, for its "ok" line."""
    try:
        added = record(store)
    except OSError as e:  # OffloadDirError among them: a store on read-only media is verified, not upgraded
        return f" (its CRC-32s could not be recorded: {e}; loads keep checking sha256)"
    return f" (CRC-32s of {added} tensors recorded: loads now check those)" if added else ""
