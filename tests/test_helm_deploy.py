"""`flexgen-helm helm-deploy`: a local checkpoint of a new family becomes a flexgen/<name>
deployment that HELM's own registries read, whose tokenizer encodes prompts as plain
text (a chat model's template unused)."""

from __future__ import annotations

import cattrs
import dacite
import pytest
import yaml
from conftest import save_tiny

pytest.importorskip("helm")

from helm.benchmark import model_deployment_registry as deployments
from helm.benchmark import model_metadata_registry as metadata
from helm.benchmark import tokenizer_config_registry as tokenizers
from helm.common.cache import BlackHoleCacheConfig
from helm.common.tokenization_request import TokenizationRequest

from flexgen_helm.cli import main
from flexgen_helm.helm import engines
from flexgen_helm.helm.tokenizer import FlexGenTokenizer
from flexgen_helm.models.tokenizer import hf_tokenizer


def test_local_checkpoint_as_a_helm_deployment(tmp_path, monkeypatch):
    ckpt = save_tiny("gemma3", tmp_path / "gemma")
    tok = hf_tokenizer(ckpt)
    tok.chat_template = "{% for m in messages %}<turn>{{ m['content'] }}<end>{% endfor %}"
    tok.save_pretrained(ckpt)
    prod = tmp_path / "prod_env"
    prod.mkdir()
    (prod / "model_deployments.yaml").write_text(yaml.safe_dump({"model_deployments": [
        {"name": "mine/other", "model_name": "mine/other", "tokenizer_name": "mine/other", "max_sequence_length": 8,
         "client_spec": {"class_name": "x.Y"}}]}))
    assert main(["helm-deploy", "tiny-gemma", str(ckpt), "--local-path", str(prod),
                 "--policy", '{"gpu_batch_size": 4}']) == 0

    deps = cattrs.structure(yaml.safe_load((prod / "model_deployments.yaml").read_text()),
                            deployments.ModelDeployments).model_deployments
    assert [d.name for d in deps] == ["mine/other", "flexgen/tiny-gemma"]  # the user's entry kept
    mine = deps[1]
    assert mine.max_sequence_length == 64 and mine.client_spec.args["policy"]["gpu_batch_size"] == 4
    tok_cfg = cattrs.structure(yaml.safe_load((prod / "tokenizer_configs.yaml").read_text()),
                               tokenizers.TokenizerConfigs).tokenizer_configs[0]
    meta = dacite.from_dict(metadata.ModelMetadataList,
                            yaml.safe_load((prod / "model_metadata.yaml").read_text())).models[0]
    assert (tok_cfg.name, meta.name, meta.num_parameters > 0) == ("flexgen/tiny-gemma",) * 2 + (True,)

    engines.clear()
    helm_tok = FlexGenTokenizer(BlackHoleCacheConfig(), tokenizer_name=tok_cfg.name, **tok_cfg.tokenizer_spec.args)
    text = "Plain completion prompt:"
    ids = helm_tok.tokenize(TokenizationRequest(text, tokenizer=tok_cfg.name, encode=True)).raw_tokens
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert ids != tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    # again: the same name is replaced, not added
    assert main(["helm-deploy", "tiny-gemma", str(ckpt), "--local-path", str(prod)]) == 0
    again = yaml.safe_load((prod / "model_deployments.yaml").read_text())["model_deployments"]
    assert [d["name"] for d in again] == ["mine/other", "flexgen/tiny-gemma"] and "policy" not in \
        again[1]["client_spec"]["args"]


def test_helm_deploy_refuses_what_it_cannot_serve(tmp_path, capsys):
    assert main(["helm-deploy", "x", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such file or directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert main(["helm-deploy", "x", str(tmp_path / "notes.txt")]) == 2
    assert "expected a Hugging Face checkpoint directory or a .gguf file" in capsys.readouterr().err
    assert main(["helm-deploy", "x", str(tmp_path), "--policy", "{gpu"]) == 2
    assert "--policy is not JSON" in capsys.readouterr().err
