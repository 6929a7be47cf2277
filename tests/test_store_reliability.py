"""Weight stores that are never read half-written, and full disks that give one clear error.

A killed conversion (three moments), a truncated file and a flipped bit are found on load
or by `flexgen-helm verify` and rebuilt; a full disk (converting, offloading the KV cache,
HELM's cache and outputs) names the path, the bytes needed and the bytes free, keeps what
was finished and leaves no partial files. The full-disk tests run on a small tmpfs made
in the test (skipped, with the reason, where this machine cannot mount one)."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch

from flexgen_helm.cli import main as cli_main
from flexgen_helm.errors import DiskFullError, WeightStoreError
from flexgen_helm.models import family_of
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.spec import all_store_tensors
from flexgen_helm.policy.policy import Compression, Policy
from flexgen_helm.weights.compressed_store import open_compressed_store
from flexgen_helm.weights.convert import convert
from flexgen_helm.weights.dummy import DummyWeights
from flexgen_helm.weights.store import MANIFEST, TensorStore

TINY = ModelConfig(family="llama", name="tiny", vocab_size=300, hidden_size=32, num_layers=2, num_heads=4,
                   num_kv_heads=2, ffn_size=64, max_seq_len=64, attention_bias=True)
LAYER = "layers.0.down_proj.weight"


def tiny_store(where):
    return convert(DummyWeights(TINY), where / "store", progress=False)


def files(folder):
    return sorted(p.name for p in folder.iterdir())


def mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


# ----- a killed conversion, a truncated file, a flipped bit ----------------------------------


class _KilledAt(DummyWeights):
    def read(self, store_name):
        if store_name == LAYER:
            raise KeyboardInterrupt("killed")
        return super().read(store_name)


def _killed_writing_a_tensor(out, monkeypatch):
    with pytest.raises(KeyboardInterrupt):
        convert(_KilledAt(TINY), out, progress=False)
    (out / f"{LAYER}.bin.tmp").write_bytes(b"\0" * 100)  # what a kill -9 mid-write leaves


def _killed_before_the_manifest(out, monkeypatch):
    from flexgen_helm.weights import convert as convert_mod

    real = convert_mod.atomic_write

    def killed(path, text):
        if path.name == MANIFEST:
            raise KeyboardInterrupt("killed")
        real(path, text)

    monkeypatch.setattr(convert_mod, "atomic_write", killed)
    with pytest.raises(KeyboardInterrupt):
        convert(DummyWeights(TINY), out, progress=False)
    monkeypatch.setattr(convert_mod, "atomic_write", real)


def _manifest_torn(out, monkeypatch):
    """Not a kill (the manifest is renamed into place whole) but a machine crash or a bad copy."""
    convert(DummyWeights(TINY), out, progress=False)
    text = (out / MANIFEST).read_text()
    (out / MANIFEST).write_text(text[: len(text) // 2])


@pytest.mark.parametrize("kill", [_killed_writing_a_tensor, _killed_before_the_manifest, _manifest_torn])
def test_a_killed_conversion_is_never_read_and_the_next_run_finishes_it(tmp_path, capsys, monkeypatch, kill):
    out = tmp_path / "store"
    kill(out, monkeypatch)
    kept = {n: t for n, t in mtimes(out).items() if n.endswith(".bin")} if kill is not _manifest_torn else {}
    with pytest.raises(WeightStoreError, match="convert"):
        TensorStore(out)
    assert convert(DummyWeights(TINY), out, progress=False) == out
    assert "a conversion was interrupted" in capsys.readouterr().err
    store = TensorStore(out, verify="full")
    assert torch.equal(store.read(LAYER), DummyWeights(TINY).read(LAYER).half())
    assert {n: t for n, t in mtimes(out).items() if n in kept} == kept  # finished tensors not written again
    assert not [n for n in files(out) if n.endswith(".tmp")]


def test_verify_finds_a_flipped_bit_and_convert_verify_rewrites_that_tensor(tmp_path, capsys):
    out = tiny_store(tmp_path)
    assert cli_main(["verify", str(out)]) == 0 and "ok" in capsys.readouterr().out
    path = out / f"{LAYER}.bin"
    data = bytearray(path.read_bytes())
    data[7] ^= 0x10
    path.write_bytes(bytes(data))
    assert cli_main(["verify", str(out)]) == 1
    assert f"tensor {LAYER}: {LAYER}.bin does not match its sha256" in capsys.readouterr().out
    with pytest.raises(WeightStoreError, match="checksum"):  # loading into memory checks it too
        TensorStore(out).read(LAYER, verify=True)
    before = mtimes(out)
    convert(DummyWeights(TINY), out, progress=False, verify=True)
    after = mtimes(out)
    assert sorted(n for n in after if after[n] != before.get(n)) == sorted([f"{LAYER}.bin", MANIFEST])
    assert cli_main(["verify", str(out)]) == 0


def test_verify_reports_a_store_without_manifest(tmp_path, capsys):
    out = tiny_store(tmp_path)
    (out / MANIFEST).unlink()
    assert cli_main(["verify", str(out)]) == 1
    assert "no manifest.json: a conversion that did not finish" in capsys.readouterr().out


def test_a_truncated_compressed_store_is_rebuilt(tmp_path, capsys):
    specs = all_store_tensors(family_of(TINY).layer_specs(TINY))
    source = DummyWeights(TINY)

    def open_store():
        return open_compressed_store(tmp_path / "q4", specs, Compression(bits=4, group_size=16), torch.float32,
                                     torch.device("cpu"), {"name": "tiny"}, source.read, progress=False)

    first = open_store().read(LAYER, (0, 32))
    victim = next(p for p in (tmp_path / "q4").iterdir() if p.name.startswith(LAYER))
    os.truncate(victim, victim.stat().st_size // 2)
    again = open_store().read(LAYER, (0, 32))
    assert "writing the compressed store again" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(first.parts, again.parts))


def test_jobs_opening_one_compressed_store_at_once_write_it_once(tmp_path):
    """Slurm jobs (or HELM workers) sharing a cache: the second waits for the first's store
    instead of deleting its half-written files and writing it again."""
    import threading
    import time

    specs = all_store_tensors(family_of(TINY).layer_specs(TINY))
    source, reads, started = DummyWeights(TINY), [], threading.Event()

    def slow_read(name):
        reads.append(name)
        started.set()
        time.sleep(0.01)  # long enough for the other job to arrive mid-write
        return source.read(name)

    stores = []

    def job():
        stores.append(open_compressed_store(tmp_path / "q4", specs, Compression(bits=4, group_size=16),
                                            torch.float32, torch.device("cpu"), {"name": "tiny"}, slow_read,
                                            progress=False))

    first = threading.Thread(target=job)
    first.start()
    assert started.wait(10)
    job()
    first.join(30)
    assert len(reads) == len(specs)  # written once
    a, b = (s.read(LAYER, (0, 32)) for s in stores)
    assert all(torch.equal(x, y) for x, y in zip(a.parts, b.parts))


# ----- full disks -------------------------------------------------------------------------


def test_conversion_onto_a_full_disk_fails_before_writing(small_fs):
    fs = small_fs(32 << 10)
    with pytest.raises(DiskFullError, match=r"the weight store at .*store needs .* bytes\), .* free"):
        convert(DummyWeights(TINY), fs / "store", progress=False)
    assert not [n for n in files(fs / "store") if n.endswith((".bin", ".tmp"))]


class _FillsTheDisk(DummyWeights):
    """Another program fills the disk while the conversion runs."""

    def __init__(self, cfg, filler):
        super().__init__(cfg)
        self.filler = filler

    def read(self, store_name):
        if store_name == LAYER and not self.filler.exists():
            with open(self.filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass
        return super().read(store_name)


def test_a_disk_that_fills_during_conversion_keeps_the_finished_tensors(small_fs):
    fs = small_fs(512 << 10)
    filler, out = fs / "filler", fs / "store"
    with pytest.raises(DiskFullError, match=r"the weight store \(still to write\) at .* needs .*, .* free"):
        convert(_FillsTheDisk(TINY, filler), out, progress=False)
    assert not [n for n in files(out) if n.endswith(".tmp")] and MANIFEST not in files(out)
    written = {n: t for n, t in mtimes(out).items() if n.endswith(".bin")}
    assert written
    filler.unlink()
    convert(DummyWeights(TINY), out, progress=False)
    assert {n: t for n, t in mtimes(out).items() if n in written} == written
    TensorStore(out, verify="full")


def test_kv_cache_on_a_full_offload_disk_fails_before_the_run(small_fs, tiny_llama):
    from flexgen_helm.engine import Engine
    from flexgen_helm.executor.sampling import SamplingParams

    fs = small_fs(16 << 10)
    engine = Engine.load(str(tiny_llama), Policy.from_percent([100, 0, 0, 0, 100, 0], overlap=False),
                         dtype="float32", device="cpu", offload_dir=fs, progress=False)
    with pytest.raises(DiskFullError, match=r"offloaded KV cache and activations at .* needs .* bytes\), .* free"):
        engine.generate([list(range(1, 41))], SamplingParams(max_new_tokens=20))  # 3 layers x 60 positions
    assert files(fs) == []  # no partial files
    short = engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(short.results[0].completions[0].token_ids) == 4  # a run that fits still runs


# ----- HELM: its cache and its outputs on a full disk -------------------------------------


@pytest.fixture
def fake_helm_engine(monkeypatch):
    pytest.importorskip("helm")
    import helm_fake_engine

    from flexgen_helm.helm import engines

    monkeypatch.setenv("FLEXGEN_HELM_ENGINE_FACTORY", "helm_fake_engine:load")
    engines.clear()
    yield helm_fake_engine
    engines.clear()


def _client(cache_config):
    from flexgen_helm.helm.client import FlexGenClient

    return FlexGenClient(cache_config, model="smollm2-135m", deployment="flexgen/smollm2-135m", max_batch_size=2)


def _requests(n):
    from helm.common.request import Request

    return [Request(model="flexgen/smollm2-135m", model_deployment="flexgen/smollm2-135m",
                    prompt=f"words {'x ' * (i % 3)}{i}", temperature=0.0, max_tokens=2) for i in range(n)]


def _cached(path):
    from helm.common.key_value_store import SqliteKeyValueStore

    with SqliteKeyValueStore(str(path)) as store:
        return len(list(store.get_all()))


def test_offload_disk_full_inside_a_helm_run_stops_it_and_keeps_finished_batches(tmp_path, fake_helm_engine):
    from helm.common.cache import SqliteCacheConfig

    from flexgen_helm.memory.disk_space import disk_full

    client = _client(SqliteCacheConfig(str(tmp_path / "cache.sqlite")))

    def full_from_the_third_call(n):
        if n >= 2:
            raise disk_full(tmp_path, 1 << 20, "this block's offloaded KV cache", "free space")

    client.handle.engine.on_call = full_from_the_third_call
    with pytest.raises(DiskFullError, match="offloaded KV cache"):
        client.prefetch(_requests(6))
    assert _cached(tmp_path / "cache.sqlite") == 4  # the two batches that finished


def test_helms_cache_on_a_full_disk_is_one_clear_error(small_fs, fake_helm_engine):
    from helm.common.cache import SqliteCacheConfig

    fs = small_fs(256 << 10)
    filler = fs / "filler"
    client = _client(SqliteCacheConfig(str(fs / "cache.sqlite")))

    def fill_at_the_third_call(n):
        if n == 2:
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass

    client.handle.engine.on_call = fill_at_the_third_call
    with pytest.raises(DiskFullError, match=r"HELM's request cache at .*cache.sqlite needs .* bytes.*, .* free"):
        client.prefetch(_requests(6))
    filler.unlink()
    assert _cached(fs / "cache.sqlite") == 4


def test_helm_outputs_on_a_full_disk_end_the_run_with_one_line(tmp_path, monkeypatch):
    pytest.importorskip("helm")
    from helm.benchmark.executor import ExecutionSpec
    from helm.benchmark.runner import Runner

    from flexgen_helm.helm.runner import BatchingRunner

    spec = ExecutionSpec(url=None, auth=None, local_path=str(tmp_path / "prod_env"), parallelism=1, dry_run=True)
    runner = BatchingRunner(spec, str(tmp_path / "out"), "suite", skip_instances=False, cache_instances=False,
                            cache_instances_only=False, skip_completed_runs=False, exit_on_error=True)
    run_spec = type("RunSpec", (), {"name": "lambada:model=x"})()
    run_path = os.path.join(runner.runs_path, run_spec.name)

    def writes_half(self, rs):
        os.makedirs(run_path, exist_ok=True)
        with open(os.path.join(run_path, "scenario_state.json"), "w") as f:
            f.write(json.dumps({"request_states": []})[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Runner, "run_one", writes_half)
    with pytest.raises(SystemExit, match=r"flexgen-helm: error: disk full: HELM's outputs of lambada:model=x at .* "
                                         r"needs more than is free, .* free; free space and run the same command"):
        runner.run_one(run_spec)
    assert os.listdir(run_path) == []


def test_plain_helm_run_with_its_outputs_on_a_full_disk_ends_with_one_line(tmp_path, small_fs):
    """Plain helm-run (no --runner-class-name), -o on a file system too small for a run's
    outputs, HELM's cache (prod_env) elsewhere: one line, no traceback, no partial outputs,
    and the same command with space computes nothing again. Two requests: the outputs of
    any run are more than the 16 KiB (scenario_state.json and stats.json alone)."""
    pytest.importorskip("helm")
    from test_helm_e2e import helm_run, helm_run_process

    from flexgen_helm.helm.outputs_guard import HELM_RUN_OUTPUTS

    entries = ["lambada:model=flexgen/smollm2-135m"]
    full = small_fs(16 << 10)
    proc = helm_run_process(tmp_path, entries, fake=True, max_instances=2, output_path=full)
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("flexgen-helm: error:")]
    assert proc.returncode != 0, text[-3000:]
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
    assert re.match(r"flexgen-helm: error: disk full: HELM's outputs of lambada:model=flexgen_smollm2-135m at "
                    r".*needs more than is free, .* free; free space and run the same command again", errors[0])
    run_dir = full / "runs" / "t" / "lambada:model=flexgen_smollm2-135m"
    assert not any((run_dir / name).exists() for name in HELM_RUN_OUTPUTS)
    log = helm_run(tmp_path, entries, fake=True, max_instances=2, output_path=tmp_path / "with-space")
    assert "flexgen: computed 0 uncached requests" in log
