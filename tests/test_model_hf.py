"""Hugging Face interop: our export loads in transformers' LlamaForCausalLM with the same logits, and back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leantrain.errors import UserInputError
from leantrain.model import build_model, model_args_from_spec
from leantrain.model.hf import export_hf
from leantrain.model.hf_load import import_hf
from leantrain.spec.schema import ModelSpec

transformers = pytest.importorskip("transformers")


def tiny_model(*, tie: bool):
    spec = ModelSpec(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=101,
                     tie_embeddings=tie, rope_theta=10000.0)
    return build_model(model_args_from_spec(spec, max_seq_len=32), device=torch.device("cpu"), seed=0)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, tie: bool) -> None:
    ours = tiny_model(tie=tie).eval()
    export_hf(ours, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_import_from_transformers_save_pretrained(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    ours = import_hf(tmp_path / "hf").eval()
    tokens = torch.randint(0, 101, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


def test_moe_export_is_refused(tmp_path: Path) -> None:
    spec = ModelSpec(n_layers=1, d_model=16, n_heads=2, ffn_hidden=32, vocab_size=20, architecture="moe",
                     moe={"num_experts": 2, "top_k": 1})
    model = build_model(model_args_from_spec(spec, max_seq_len=8), device=torch.device("cpu"))
    with pytest.raises(UserInputError, match="mixture-of-experts"):
        export_hf(model, tmp_path / "hf")


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.mark.parametrize(("model_type", "extra"), [
    ("llama", {"rope_scaling": LLAMA3_ROPE, "tie_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("mistral", {}),
    ("qwen2", {}),
    ("mistral", {"head_dim": 32}),
    ("llama", {"head_dim": 8}),
], ids=["llama-rope3-tied", "llama-linear", "mistral", "qwen2-biases", "mistral-wide-heads", "llama-narrow-heads"])
def test_hf_checkpoints_load_with_transformers_logits_and_export_back(
    tmp_path: Path, model_type: str, extra: dict
) -> None:
    from leantrain.model.tiny_hf import save_tiny_hf
    from leantrain.spec.hf_config import read_hf_config

    hf_dir = save_tiny_hf(tmp_path / "hf", model_type=model_type, vocab_size=101, max_positions=128, **{
        "tie_embeddings": extra.get("tie_embeddings", False), "rope_scaling": extra.get("rope_scaling"),
        "head_dim": extra.get("head_dim")})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = import_hf(hf_dir, max_seq_len=96).eval()
    assert ours.args.shape.qkv_bias == (model_type == "qwen2")
    if "head_dim" in extra:  # 4 heads of 32 (or 8) on a 64-wide model: q is 128 (32) wide, not 64
        assert ours.args.shape.head_dim == extra["head_dim"] != 64 // 4
        assert ours.layers["0"].attention.wq.weight.shape == (4 * extra["head_dim"], 64)
    tokens = torch.randint(0, 101, (2, 96), generator=torch.Generator().manual_seed(0))  # past the 32-token context
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)
    base = json.loads((hf_dir / "config.json").read_text())
    export_hf(ours, tmp_path / "out", base=base)
    assert read_hf_config(tmp_path / "out").model_type == model_type
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, theirs(tokens).logits, rtol=0, atol=1e-5)


def test_rope_scaling_changes_the_frequencies_as_transformers_does() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from leantrain.model.rope import inv_frequencies

    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_scaling=LLAMA3_ROPE,
                                      max_position_embeddings=256)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = inv_frequencies(head_dim=128, theta=config.rope_parameters["rope_theta"],
                          scaling=tuple(sorted(LLAMA3_ROPE.items())))
    torch.testing.assert_close(got, expected.float())
    assert not torch.allclose(got, inv_frequencies(head_dim=128, theta=config.rope_parameters["rope_theta"]))


def test_sharded_checkpoint_with_an_index_is_written_and_read(tmp_path: Path) -> None:
    from leantrain.model.hf import plan_shards

    ours = tiny_model(tie=False).eval()
    sizes = {name: t.numel() * 4 for name, t in ours.state_dict().items()}
    shards = plan_shards(sizes, max_shard_bytes=20_000)
    assert len(shards) > 2 and sorted(sum(shards, [])) == sorted(sizes)
    from leantrain.model.hf import hf_config, write_hf_shards

    state = ours.state_dict()
    write_hf_shards(tmp_path / "hf", shards=shards, load=lambda names: {n: state[n] for n in names},
                    config=hf_config(ours.args))
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    again = import_hf(tmp_path / "hf", max_seq_len=32).eval()
    tokens = torch.randint(0, 101, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), ours(tokens), rtol=0, atol=0)


def test_a_stage_opens_only_the_files_of_its_layers_once_the_headers_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 checks names and shapes once (`check_hf_dir`, reading headers); with that owner map a pipeline
    stage reads no header again and opens only the safetensors files holding its own layers."""
    import os

    from safetensors.torch import load_file, save_file

    from leantrain.model.hf import INDEX_FILE, args_from_hf_config
    from leantrain.model.hf_load import check_hf_dir, fill_from_hf
    from leantrain.model.init import init_buffers
    from leantrain.model.tiny_hf import save_tiny_hf
    from leantrain.model.transformer import Transformer
    from leantrain.parallel.pipeline import build_stage_modules

    hf = save_tiny_hf(tmp_path / "hf", vocab_size=320, num_layers=4, tokenizer=False)
    tensors = {}
    for file in sorted(hf.glob("*.safetensors")):
        tensors.update(load_file(file))
        file.unlink()
    weight_map = {}
    for name in tensors:  # one file per layer, one for the rest (a sharded export's shape)
        part = f"layer{name.split('.')[2]}" if name.startswith("model.layers.") else "rest"
        weight_map[name] = f"model-{part}.safetensors"
    for file in sorted(set(weight_map.values())):
        save_file({n: t.contiguous() for n, t in tensors.items() if weight_map[n] == file}, str(hf / file))
    (hf / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    args = args_from_hf_config(hf, max_seq_len=16)
    owners = check_hf_dir(hf, args=args)
    assert set(owners.values()) == set(weight_map.values())
    whole = import_hf(hf, max_seq_len=16)
    with torch.device("meta"):
        meta = Transformer(args)
    (_, stage), = build_stage_modules(meta, pp_rank=1, pp=2, virtual_stages=1)  # layers 2, 3 and the head
    stage.to_empty(device=torch.device("cpu"))
    init_buffers(stage, args=args, device=torch.device("cpu"))
    import leantrain.model.hf_load as hf_load

    opened: list[str] = []
    real_open = hf_load.safe_open

    def spied(path: str, *a: object, **k: object) -> object:  # safetensors opens files in Rust: spy on the call
        opened.append(os.path.basename(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(hf_load, "safe_open", spied)
    fill_from_hf(stage, hf, args=args, owners=owners)
    assert sorted(opened) == ["model-layer2.safetensors", "model-layer3.safetensors", "model-rest.safetensors"]
    reference = dict(whole.named_parameters())
    for name, param in stage.named_parameters():
        assert torch.equal(param, reference[name]), name


def test_a_config_head_dim_is_read_and_a_bad_one_names_the_field(tmp_path: Path) -> None:
    from leantrain.spec.hf_config import HFConfigError, read_hf_config

    base = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 5120,
            "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 2, "intermediate_size": 64,
            "vocab_size": 100, "head_dim": 128}  # Mistral NeMo's heads: 32 × 128 = 4096 on a 5120-wide model
    (tmp_path / "config.json").write_text(json.dumps(base))
    assert read_hf_config(tmp_path).head_dim == 128
    for bad in (7, "128", None):
        (tmp_path / "config.json").write_text(json.dumps({**base, "head_dim": bad, "hidden_size": 5000}))
        with pytest.raises(HFConfigError, match="config.json: field 'head_dim'"):
            read_hf_config(tmp_path)


def test_a_damaged_safetensors_file_is_named_by_the_check_and_by_a_later_read(tmp_path: Path) -> None:
    """A shard of an indexed checkpoint cut short fails rank 0's header check naming it; a file that changes after
    the check (cut, or removed, while a download is redone) is named by the rank that reads it."""
    import re

    from leantrain.model.hf import args_from_hf_config, hf_config, plan_shards, write_hf_shards
    from leantrain.model.hf_load import check_hf_dir, fill_from_hf
    from leantrain.model.init import init_buffers
    from leantrain.model.transformer import Transformer

    ours = tiny_model(tie=False)
    state = ours.state_dict()
    shards = plan_shards({name: t.numel() * 4 for name, t in state.items()}, max_shard_bytes=20_000)
    hf = write_hf_shards(tmp_path / "hf", shards=shards, load=lambda names: {n: state[n] for n in names},
                         config=hf_config(ours.args))
    args = args_from_hf_config(hf, max_seq_len=32)
    owners = check_hf_dir(hf, args=args)
    shard = hf / f"model-00002-of-{len(shards):05d}.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserInputError, match=re.escape(f"{shard}: not a readable safetensors file")):
        check_hf_dir(hf, args=args)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=torch.device("cpu"))
    init_buffers(model, args=args, device=torch.device("cpu"))
    with pytest.raises(UserInputError, match=re.escape(f"{shard}: not a readable safetensors file")):
        fill_from_hf(model, hf, args=args, owners=owners)  # checked whole before, cut since
    shard.unlink()
    with pytest.raises(UserInputError, match=re.escape(f"{shard}: cannot be read")):
        fill_from_hf(model, hf, args=args, owners=owners)
    shard.write_bytes(whole)
    fill_from_hf(model, hf, args=args, owners=owners)
    for name, param in model.named_parameters():
        assert torch.equal(param, state[name]), name


def test_an_export_without_a_tokenizer_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`leantrain export` of a run whose data dir (and model.init_from) hold no tokenizer.json wrote a model dir
    without one and said "exported ... as a Hugging Face model" without a word: the export names what is missing."""
    import io

    from rich.console import Console

    from leantrain.ckpt import export
    from leantrain.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml",
                     overrides=[f"data.dir={tmp_path / 'data'}"])
    out = tmp_path / "hf"
    out.mkdir()
    assert export._copy_tokenizer(spec, out) == f"no tokenizer.json in {tmp_path / 'data'}"
    assert not any(out.iterdir())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokenizer.json").write_text("{}")
    assert export._copy_tokenizer(spec, out) == "" and (out / "tokenizer.json").is_file()
    console = Console(file=io.StringIO(), width=200)
    result = export.ExportResult(out_dir=out, step=3, num_tensors=1, merged_lora=False, adapter_only=False,
                                 no_tokenizer="no tokenizer.json in /gone")
    monkeypatch.setattr(export, "export_run", lambda *a, **k: result)
    export.run(console=console, run_dir=tmp_path, out=out, step=None, adapter_only=False)
    assert "warning: no tokenizer.json in /gone: the model dir has no tokenizer" in console.file.getvalue()
