"""The command line as a new user meets it (issue 18): repeated flags accumulate, output
paths are made ready or rejected before any work starts, a search needs no weights, long
commands show their progress on stderr and leave stdout as it was."""

from __future__ import annotations

import json

import pytest
from test_policy_search import cpu_profile

from flexgen_helm.cli import build_parser, main
from flexgen_helm.engine import Engine
from flexgen_helm.errors import OffloadDirError
from flexgen_helm.policy import Policy, Split


def test_repeated_prompt_and_stop_flags_accumulate():
    args = build_parser().parse_args(["generate", "--prompt", "a", "--prompt", "b", "c", "--stop", "x", "--stop", "y"])
    assert args.prompt == ["a", "b", "c"] and args.stop == ["x", "y"]


def test_a_path_without_a_model_names_its_own_checkpoint(tiny_llama):
    """--path alone runs that checkpoint under its own name, not the default model's."""
    from flexgen_helm.cli.options import settle_model_args
    from flexgen_helm.weights.registry import resolve

    def settled(*argv):
        args = build_parser().parse_args(["bench", *argv])
        settle_model_args(args)
        return args

    args = settled("--path", str(tiny_llama))
    assert (args.model, args.path) == (str(tiny_llama), None)
    assert resolve(args.model, path=args.path).config.name != "smollm2-135m"
    assert (settled().model, settled().path) == ("smollm2-135m", None)
    named = settled("--model", "smollm2-135m", "--path", str(tiny_llama))  # named explicitly: kept as given
    assert (named.model, named.path) == ("smollm2-135m", str(tiny_llama))


@pytest.fixture
def blocked(tmp_path):
    """A path under a file: no folder can be made there."""
    file = tmp_path / "a-file"
    file.write_text("x")
    return file / "sub"


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi", "--json", "{blocked}/x.json"],
    ["bench", "--json", "{blocked}/x.json"],
    ["eval", "--task", "lambada", "--json", "{blocked}/x.json"],
    ["search", "--json", "{blocked}/x.json"],
    ["report", "--out", "{blocked}"],
    ["leaderboard", "--out", "{blocked}"],
    ["demo", "--out", "{blocked}"],
    ["demo", "--output-path", "{blocked}", "--out", "{tmp}"],
    ["compare", "--out", "{blocked}"],
    ["compare-llamacpp", "--out", "{blocked}"],
])
def test_output_paths_are_rejected_before_any_work(argv, blocked, tmp_path, capsys):
    """The model does not exist and no suite was run: an error about either would mean that
    work started before the output path was checked."""
    argv = [a.format(blocked=blocked, tmp=tmp_path) for a in argv]
    assert main([*argv, "--model", "no-such-model"] if argv[0] in ("generate", "bench", "eval", "search")
                else argv) == 2
    assert "cannot create the output folder" in capsys.readouterr().err


def test_missing_output_folders_are_created(tiny_llama, tmp_path, capsys):
    out = tmp_path / "missing" / "dir" / "x.json"
    assert main(["generate", "--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32", "--prompt", "a",
                 "--prompt", "b", "--max-new-tokens", "2", "--offload-dir", str(tmp_path / "off"),
                 "--json", str(out)]) == 0
    assert [r["prompt"] for r in json.loads(out.read_text())["results"]] == ["a", "b"]


def test_an_unusable_offload_dir_is_an_error_before_the_model_loads(tiny_llama, blocked):
    with pytest.raises(OffloadDirError, match=f"offload directory {blocked} is not usable"):
        Engine.load(str(tiny_llama), Policy(cache=Split(0, 0, 1)), dtype="float32", device="cpu",
                    offload_dir=blocked, progress=False)


def test_search_plans_from_the_config_alone(tmp_path, capsys):
    """No --dummy and no weights on this machine: the search needs neither."""
    prof = cpu_profile().save(tmp_path / "hw.json")
    assert main(["search", "--model", "facebook/opt-6.7b", "--prompt-len", "128", "--gen-len", "8", "--cpu-mem",
                 "4GiB", "--profile", str(prof), "--max-gpu-batch-size", "4", "--max-num-gpu-batches", "2"]) == 0
    assert "policy:" in capsys.readouterr().out


def test_bench_shows_its_decode_steps_on_stderr_only(tiny_opt, tmp_path, capsys):
    argv = ["bench", "--model", str(tiny_opt), "--device", "cpu", "--dtype", "float32", "--prompt-len", "8",
            "--gen-len", "4", "--gpu-batch-size", "2", "--offload-dir", str(tmp_path),
            "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "bench: decode" in err and "3/3" in err  # the steps after the prefill, counted to the end
    assert "bench" not in out and out.startswith("model: ")
    assert json.loads((tmp_path / "b.json").read_text())["gen_len"] == 4
    assert main([*argv, "--quiet"]) == 0
    assert "bench" not in capsys.readouterr().err
