"""rewind convert: GGUF name mapping, llama.cpp's storage conventions undone, round trips through a
GGUF written the way llama.cpp writes one, bad files, atomicity and the lock. No real model here
(see test_default_model.py); these run on tiny random-weight models in seconds."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from rewind.models.conversion import QuantSpec, atomic_folder, convert, is_model_folder
from rewind.models.gguf_file import GgufError, GgufFile
from rewind.models.gguf_import import fix_tensor, hf_tensor_name, unpermute_rope_rows
from rewind.models.registry import ModelNotFoundError, resolve_model


# -- llama.cpp's side, written from convert_hf_to_gguf.py -----------------------------------------

def llamacpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py (HF rows -> GGML rope layout)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str, arch: str) -> str:
    """llama.cpp's name for an HF tensor (the subset the tiny models use)."""
    if hf_name.startswith("model.layers."):
        _, _, index, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        table = dict(_HF_TO_GGUF_LAYER)
        if arch == "gemma3":
            table.update({"pre_feedforward_layernorm": "ffn_norm", "post_attention_layernorm": "post_attention_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"})
        else:
            table["post_attention_layernorm"] = "ffn_norm"
        return f"blk.{index}.{table[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def write_llamacpp_gguf(model_dir: Path, path: Path, arch: str, q8_tensors: tuple[str, ...] = (),
                        types: dict[str, GGMLQuantizationType] | None = None) -> None:
    """Export an mlx-lm folder to GGUF the way llama.cpp's converter does: its names, q/k rows
    permuted for llama, Gemma norms stored as w + 1, config as metadata, the BPE vocabulary.
    `types`: the storage of tensors by GGUF name without the layer (e.g. "attn_q": Q5_0)."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = mx.load(str(model_dir / "model.safetensors"))
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if "sliding_window" in config:
        writer.add_sliding_window(config["sliding_window"])
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    specials = {token["content"] for token in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in specials else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_add_bos_token(True)
    writer.add_eos_token_id(config["eos_token_id"][0])
    for name, value in weights.items():
        array = np.array(value.astype(mx.float32))
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = llamacpp_permute(array, config["num_attention_heads"])
        if arch == "llama" and name.endswith("k_proj.weight"):
            array = llamacpp_permute(array, config["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0
        target = gguf_name(name, arch)
        short = target.split(".")[-2]
        qtype = GGMLQuantizationType.Q8_0 if target in q8_tensors else (types or {}).get(short)
        if qtype is None or array.ndim != 2:
            writer.add_tensor(target, array)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(target, array.astype(np.float16))
        elif qtype == GGMLQuantizationType.IQ4_NL:  # no quantizer in gguf-py: random blocks
            blocks = np.random.default_rng(0).integers(0, 256, (array.shape[0], array.shape[1] // 32, 18),
                                                       dtype=np.uint8)
            blocks[..., :2] = np.array([0.01], np.float16).view(np.uint8)
            writer.add_tensor(target, blocks.reshape(array.shape[0], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(target, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_variant(out_dir: Path, tiny_dir: Path, **changes) -> Path:
    """A tiny random model built from a tiny factory model's config with `changes` (another family or
    layer pattern), with random norm weights too so that a wrong norm shift cannot go unseen; the
    tokenizer is the tiny factory's."""
    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = {**json.loads((tiny_dir / "config.json").read_text()), **changes}
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.random.seed(7)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda v: v * 2.0 if v.ndim >= 2 else mx.random.normal(v.shape) * 0.3,
                          model.parameters()))
    mx.eval(model.parameters())
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((tiny_dir / name).read_bytes())
    return out_dir


def source_model(arch: str, tiny_model_path, out_dir: Path) -> Path:
    """A tiny model of `arch` as the converter expects it (Gemma 3: five sliding layers, one global)."""
    if arch == "gemma3":
        return build_variant(out_dir, tiny_model_path("gemma3"), num_hidden_layers=6, sliding_window_pattern=6)
    if arch in ("qwen2", "qwen3"):
        return build_variant(out_dir, tiny_model_path("llama"), model_type=arch)
    return tiny_model_path("llama")


def last_logits(model_dir: Path, tokens: list[int], dtype=mx.bfloat16) -> np.ndarray:
    from mlx.utils import tree_map
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    model.update(tree_map(lambda v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v,
                          model.parameters()))
    return np.array(model(mx.array([tokens]))[0, -1].astype(mx.float32))


PROMPT = [1, 40, 41, 42, 100, 200, 300, 17, 5, 99]


# -- unit tests ----------------------------------------------------------------------------------

def test_tensor_names_map_to_hf_names():
    assert hf_tensor_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight", "qwen3") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight", "gemma3") == "model.norm.weight"
    assert hf_tensor_name("blk.11.attn_output.weight", "qwen2") == "model.layers.11.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias", "qwen2") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_k_norm.weight", "qwen3") == "model.layers.3.self_attn.k_norm.weight"
    # ffn_norm is the pre-MLP norm: post_attention_layernorm for llama, pre_feedforward for Gemma
    assert hf_tensor_name("blk.2.ffn_norm.weight", "llama") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.post_attention_norm.weight", "gemma3") == \
        "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"


def test_unknown_tensor_name_is_named_in_the_error():
    with pytest.raises(GgufError, match="blk.0.ssm_conv1d.weight"):
        hf_tensor_name("blk.0.ssm_conv1d.weight", "llama")
    with pytest.raises(GgufError, match="post_ffw_norm"):
        hf_tensor_name("blk.0.post_ffw_norm.weight", "llama")  # a Gemma-only norm in a llama file


def test_unpermute_inverts_llamacpp_permute():
    rng = np.random.default_rng(0)
    for n_head, rows in ((4, 64), (2, 32), (1, 16)):
        weight = rng.standard_normal((rows, 24)).astype(np.float32)
        assert not np.array_equal(llamacpp_permute(weight, n_head), weight)
        np.testing.assert_array_equal(unpermute_rope_rows(llamacpp_permute(weight, n_head), n_head), weight)


def test_fix_tensor_undoes_gemma_norm_shift_only_on_gemma_norms():
    stored = np.array([1.5, 0.25, 2.0], dtype=np.float32)
    config = {"num_attention_heads": 2, "num_key_value_heads": 1}
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.4.self_attn.q_norm.weight",
                 "model.layers.1.post_feedforward_layernorm.weight", "model.norm.weight"):
        np.testing.assert_allclose(fix_tensor(name, stored, "gemma3", config), stored - 1.0)
    np.testing.assert_array_equal(fix_tensor("model.norm.weight", stored, "llama", config), stored)
    np.testing.assert_array_equal(fix_tensor("model.layers.0.mlp.up_proj.weight", stored, "gemma3", config), stored)


def test_llama3_rope_table_gives_back_its_parameters():
    from rewind.models.gguf_import import llama3_rope_factors, llama3_rope_scaling

    for factor in (8.0, 32.0):
        table = llama3_rope_factors(factor, 1.0, 4.0, 8192, 500000.0, 128).astype(np.float32)
        # unscaled high frequencies, fully scaled low ones, and smoothed ones between
        assert table.min() == 1.0 and table.max() == factor and ((table > 1.0) & (table < factor)).any()
        assert llama3_rope_scaling(table, 500000.0, 128) == {
            "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    other = llama3_rope_factors(8.0, 2.0, 4.0, 4096, 500000.0, 128).astype(np.float32)
    with pytest.raises(GgufError, match="rope_freqs.weight"):
        llama3_rope_scaling(other, 500000.0, 128, "odd.gguf")


def test_quant_spec_forms():
    assert QuantSpec(16).form == "bf16"
    assert QuantSpec(8).form == "q8"
    assert QuantSpec(4, 32).form == "q4g32"
    assert QuantSpec.from_form("q4g32") == QuantSpec(4, 32)
    with pytest.raises(ValueError):
        QuantSpec(3)
    with pytest.raises(ValueError):
        QuantSpec.from_form("fp8")


# -- round trips through a llama.cpp-style GGUF -------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_gguf_round_trip_gives_the_same_model(arch, tiny_model_path, tmp_path):
    source = source_model(arch, tiny_model_path, tmp_path / "source")
    gguf_path = tmp_path / "model.gguf"
    write_llamacpp_gguf(source, gguf_path, arch)
    out = convert(gguf_path, tmp_path / "converted", QuantSpec(16), show_progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("gemma3_text" if arch == "gemma3" else arch)
    np.testing.assert_allclose(last_logits(out, PROMPT), last_logits(source, PROMPT), rtol=1e-5, atol=1e-5)

    # the tokenizer rebuilt from the GGUF vocabulary encodes like the original one
    from mlx_lm.utils import load_tokenizer

    text = "The Eiffel Tower is located in the city of Paris."
    assert load_tokenizer(out).encode(text) == load_tokenizer(source).encode(text)


def test_gemma_round_trip_without_norm_fix_differs(tiny_model_path, tmp_path):
    """The norm fix is needed: leaving llama.cpp's w + 1 in place changes the model."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import load

    source = source_model("gemma3", tiny_model_path, tmp_path / "source")
    write_llamacpp_gguf(source, tmp_path / "model.gguf", "gemma3")
    out = convert(tmp_path / "model.gguf", tmp_path / "converted", QuantSpec(16), show_progress=False)
    model, _ = load(str(out))
    model.update(tree_unflatten([(n, v + 1.0) for n, v in tree_flatten(model.parameters())
                                 if n.endswith("norm.weight")]))
    unfixed = np.array(model(mx.array([PROMPT]))[0, -1].astype(mx.float32))
    assert np.abs(unfixed - last_logits(source, PROMPT)).max() > 0.1


def test_quantized_gguf_tensors_are_dequantized(tiny_model_path, tmp_path):
    source = tiny_model_path("llama")
    q8 = ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight")
    write_llamacpp_gguf(source, tmp_path / "model.gguf", "llama", q8_tensors=q8)
    with GgufFile(tmp_path / "model.gguf") as gguf:
        assert gguf.tensors["blk.0.attn_q.weight"].qtype == GGMLQuantizationType.Q8_0
    out = convert(tmp_path / "model.gguf", tmp_path / "converted", QuantSpec(16), show_progress=False)
    reference = last_logits(source, PROMPT)
    # Q8_0 is close to the float weights, but not equal
    assert np.abs(last_logits(out, PROMPT) - reference).max() < 0.05 * np.abs(reference).max()


def test_convert_quantizes_on_request(tiny_model_path, tmp_path):
    source = tiny_model_path("llama")
    write_llamacpp_gguf(source, tmp_path / "model.gguf", "llama")
    out = convert(tmp_path / "model.gguf", tmp_path / "q8", QuantSpec(8, 32), show_progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    reference = last_logits(source, PROMPT, mx.float32)
    assert np.abs(last_logits(out, PROMPT, mx.float32) - reference).max() < 0.05 * np.abs(reference).max()


def test_convert_hf_folder(tiny_model_path, tmp_path):
    source = tiny_model_path("gemma3")
    out = convert(source, tmp_path / "converted", QuantSpec(16), show_progress=False)
    assert json.loads((out / "rewind.json").read_text())["form"] == "bf16"
    np.testing.assert_allclose(last_logits(out, PROMPT), last_logits(source, PROMPT), rtol=1e-5, atol=1e-5)


# -- bad input -----------------------------------------------------------------------------------

def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(GgufError, match="not a GGUF"):
        GgufFile(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GgufError, match="empty"):
        GgufFile(tmp_path / "empty.gguf")


def test_truncated_gguf_names_the_tensor(tiny_model_path, tmp_path):
    write_llamacpp_gguf(tiny_model_path("llama"), tmp_path / "model.gguf", "llama")
    data = (tmp_path / "model.gguf").read_bytes()
    with GgufFile(tmp_path / "model.gguf") as gguf:
        last = max(gguf.tensors.values(), key=lambda tensor: tensor.offset)
    (tmp_path / "cut.gguf").write_bytes(data[: last.offset + 10])
    with pytest.raises(GgufError, match=f"tensor '{last.name}'.*truncated"):
        GgufFile(tmp_path / "cut.gguf")
    (tmp_path / "cut_header.gguf").write_bytes(data[:200])
    with pytest.raises(GgufError, match="truncated|past the end"):
        GgufFile(tmp_path / "cut_header.gguf")


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GgufError, match="architecture 'mamba' is not supported"):
        convert(path, tmp_path / "out", QuantSpec(16), show_progress=False)
    assert not (tmp_path / "out").exists()


def test_nan_in_a_tensor_is_named(tiny_model_path, tmp_path):
    source = tiny_model_path("llama")
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((source / name).read_bytes())
    weights = dict(mx.load(str(source / "model.safetensors")))
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"] * float("nan")
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    write_llamacpp_gguf(broken, tmp_path / "model.gguf", "llama")
    with pytest.raises(GgufError, match="blk.1.ffn_up.weight"):
        convert(tmp_path / "model.gguf", tmp_path / "out", QuantSpec(16), show_progress=False)


def test_unknown_model_error_lists_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model")
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert "no-such-model" in message and "rewind models" in message
    assert str(tmp_path / "home" / "models" / "no-such-model") in message
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_converted_model_resolves_by_name(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    from rewind import paths
    from rewind.models.registry import list_models

    out = convert(tiny_model_path("llama"), paths.models_dir() / "tiny-llama", QuantSpec(16), show_progress=False)
    assert resolve_model("tiny-llama") == out
    assert resolve_model(str(out)) == out
    names = {entry.name: entry for entry in list_models([tiny_model_path("gemma3")])}
    assert names["tiny-llama"].kind == "converted" and names["tiny-llama"].ready
    assert names["default"].kind == "default"
    assert names[str(tiny_model_path("gemma3"))].kind == "local"


def test_gguf_tokenizer_uses_the_generic_class_and_earlier_conversions_are_upgraded(
        tiny_model_path, tmp_path, monkeypatch):
    """The generic fast class loads tokenizer.json as it is (the model-specific ones rebuild it,
    slower and larger), and the added tokens are in tokenizer_config.json (so transformers does
    not parse tokenizer.json a second time); a folder an earlier Rewind wrote with
    GemmaTokenizer and no added tokens is brought up to that when resolved, and folders Rewind
    did not convert are left alone."""
    from rewind import paths
    from rewind.models.gguf_tokenizer import GENERIC_TOKENIZER_CLASS

    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "tiny.gguf"
    write_llamacpp_gguf(tiny_model_path("gemma3"), gguf, "gemma3")
    out = convert(gguf, paths.models_dir() / "tiny-gemma", QuantSpec(16), show_progress=False)
    config_path = out / "tokenizer_config.json"
    written = json.loads(config_path.read_text())
    assert written["tokenizer_class"] == GENERIC_TOKENIZER_CLASS
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    assert len(added) > 0
    assert written["added_tokens_decoder"] == {
        str(token.pop("id")): token for token in added}

    earlier = written | {"tokenizer_class": "GemmaTokenizer"}
    del earlier["added_tokens_decoder"]
    config_path.write_text(json.dumps(earlier))
    assert resolve_model("tiny-gemma") == out
    assert json.loads(config_path.read_text()) == written

    local = tmp_path / "local"
    local.mkdir()
    for name in ("config.json", "model.safetensors"):
        (local / name).write_bytes((out / name).read_bytes())
    (local / "tokenizer_config.json").write_text(json.dumps(earlier))
    assert resolve_model(str(local)) == local
    assert json.loads((local / "tokenizer_config.json").read_text()) == earlier


# -- atomicity and the lock ----------------------------------------------------------------------

def test_interrupted_conversion_leaves_nothing(tiny_model_path, tmp_path, monkeypatch):
    import rewind.models.gguf_import as gguf_import

    write_llamacpp_gguf(tiny_model_path("llama"), tmp_path / "model.gguf", "llama")
    out_parent = tmp_path / "models"
    real_fix = gguf_import.fix_tensor
    seen = []

    def ctrl_c_on_fifth_tensor(*args, **kwargs):
        seen.append(args[0])
        if len(seen) == 5:
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        return real_fix(*args, **kwargs)

    monkeypatch.setattr(gguf_import, "fix_tensor", ctrl_c_on_fifth_tensor)
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "model.gguf", out_parent / "model", QuantSpec(16), show_progress=False)
    assert len(seen) == 5
    assert [p.name for p in out_parent.iterdir()] == [".model.lock"]  # no model, no partial folder


def test_atomic_folder_renames_only_on_success(tmp_path):
    with atomic_folder(tmp_path / "done") as temp:
        (temp / "file").write_text("x")
        assert not (tmp_path / "done").exists()
    assert (tmp_path / "done" / "file").read_text() == "x"
    with pytest.raises(RuntimeError):
        with atomic_folder(tmp_path / "failed") as temp:
            (temp / "file").write_text("x")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done"]
    with pytest.raises(FileExistsError):
        with atomic_folder(tmp_path / "done"):
            pass


def _convert_in_child(gguf_path: str, out: str, queue) -> None:
    result = convert(Path(gguf_path), Path(out), QuantSpec(16), show_progress=False)
    queue.put(str(result))


def test_two_processes_converting_at_once_share_one_result(tiny_model_path, tmp_path):
    write_llamacpp_gguf(tiny_model_path("llama"), tmp_path / "model.gguf", "llama")
    out = tmp_path / "models" / "model"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    children = [context.Process(target=_convert_in_child, args=(str(tmp_path / "model.gguf"), str(out), queue))
                for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=120)
        assert child.exitcode == 0
    assert sorted(queue.get(timeout=5) for _ in children) == [str(out), str(out)]
    assert is_model_folder(out)
    assert sorted(p.name for p in out.parent.iterdir()) == [".model.lock", "model"]


# -- the commands --------------------------------------------------------------------------------

def run_cli(argv: list[str]) -> int:
    from rewind.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.func(args)


def test_convert_and_models_commands(tiny_model_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    write_llamacpp_gguf(tiny_model_path("llama"), tmp_path / "tiny.gguf", "llama")
    assert run_cli(["convert", str(tmp_path / "tiny.gguf"), "--q-bits", "8"]) == 0
    out = tmp_path / "home" / "models" / "tiny-q8"
    assert str(out) in capsys.readouterr().out and is_model_folder(out)
    assert run_cli(["models"]) == 0
    listing = capsys.readouterr().out
    assert "tiny-q8" in listing and "default" in listing
    # a .gguf path given as a model is converted once, then found by its name
    assert resolve_model(str(tmp_path / "tiny.gguf")) == tmp_path / "home" / "models" / "tiny-bf16"
    assert resolve_model("tiny-bf16") == tmp_path / "home" / "models" / "tiny-bf16"

    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    assert run_cli(["convert", str(tmp_path / "junk.gguf"), "--out", str(tmp_path / "junk")]) == 1
    assert "junk.gguf" in capsys.readouterr().err
    assert not (tmp_path / "junk").exists()
