"""Every decoder-only text family pgs supports, end to end on a tiny random config of each
(tests/tiny.py ``FAMILIES``; the table in docs/models.md):

- packed isolation: every packed document's logits, and the parameter gradients of a weighted
  sum of them, equal the document alone (documents longer than the 8-token sliding windows,
  GPT-OSS's attention sinks included), through pgs's training forward with the attention
  ``"auto"`` picks on the CPU, and again through ``"varlen"`` (its CPU reference) for the
  families whose ``"auto"`` takes it on CUDA (DeepSeek-V3's values narrower than its keys);
- compiled layers: ``compile_layers`` with dynamo's ``eager`` backend (the layers traced, the
  captured graphs run as they are: AOT autograd and inductor's code generation are not run on
  the CPU) gives the same packed logits and gradients (not run for the hybrid families, whose
  packed isolation tests/integration/test_hybrid_packing.py proves);
- chat masks with a template in the family's style (tests/templates/): exactly the assistant's
  answers train, their end-of-reply token included;
- ``pgs run`` (packed, gradient release, 2 steps, export) and the exported folder reloaded by
  the family's own class, every weight found, generating.

One model per family and test; the run is one in-process ``pgs run`` per family.
"""

from __future__ import annotations

import json

import pytest
import torch

from pgs.runtime.data import Document, collate, packing_isolation
from pgs.runtime.model.attention import varlen_suits
from pgs.runtime.model.build import build_model, final_hidden
from pgs.runtime.model.layers import compile_layers
from helpers import QUICKSTART, cpu_spec, step_records
from tiny import FAMILIES, family_table
from test_data_templates import FAMILY_TOKENS, PLAIN, family_tokenizer, trained_runs

#: The causal LM class transformers builds for each family (what the export must reload as).
CLASSES = {
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM", "olmo3": "Olmo3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "gpt_oss": "GptOssForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}
#: The template (tests/templates/, or one pgs ships) in each family's style, and the family's
#: special tokens (test_data_templates.FAMILY_TOKENS).
TEMPLATES = {
    "qwen3": ("qwen3", "qwen3"), "qwen3_moe": ("qwen3", "qwen3"), "qwen3_5_text": ("qwen3", "qwen3"),
    "qwen3_5_moe_text": ("qwen3", "qwen3"), "qwen3_next": ("qwen3", "qwen3"), "olmo_hybrid": ("qwen3", "chatml"),
    "olmo3": ("qwen3", "chatml"), "gemma3_text": ("gemma3", "gemma3"), "gemma4_text": ("gemma3", "gemma3"),
    "llama": ("llama3", "llama3"), "mistral": ("mistral", "mistral_v7"), "gpt_oss": ("gpt_oss", "gpt_oss"),
    "deepseek_v3": ("deepseek_r1", "deepseek_r1"), "glm4_moe": ("glm4", "glm4"),
}
#: What trains of ``PLAIN``'s two answers, by template.
ANSWERS = {
    "qwen3": ["Hello.<|im_end|>", "4<|im_end|>"], "chatml": ["Hello.<|im_end|>", "4<|im_end|>"],
    "gemma3": ["Hello.<end_of_turn>", "4<end_of_turn>"], "llama3": ["Hello.<|eot_id|>", "4<|eot_id|>"],
    "mistral_v7": ["Hello.</s>", "4</s>"],
    "gpt_oss": ["<|channel|>final<|message|>Hello.<|return|>", "<|channel|>final<|message|>4<|return|>"],
    "deepseek_r1": ["Hello.<｜end▁of▁sentence｜>", "4<｜end▁of▁sentence｜>"],
    "glm4": ["\n<think></think>\nHello.<|endoftext|>", "\n<think></think>\n4<|endoftext|>"],
}
FAMILY_TOKENS.setdefault("gpt_oss", ({}, ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>",
                                          "<|call|>", "<|constrain|>"]))
FAMILY_TOKENS.setdefault("glm4", ({"eos_token": "<|endoftext|>"}, ["[gMASK]", "<sop>", "<|system|>", "<|user|>",
                                                                  "<|assistant|>", "<|observation|>"]))
#: Documents of 7, 20 and 9 tokens (20 > the 8-token windows) in two padded rows of 40.
LENGTHS, WIDTH, VOCAB = (7, 20, 9), 40, 96


def tiny(family: str):
    return build_model(config=family_table(family, max_position_embeddings=128), attn_implementation="auto").eval()


def rows():
    g = torch.Generator().manual_seed(1)
    docs = [Document(tuple(torch.randint(3, VOCAB, (n,), generator=g).tolist()), (True,) * n) for n in LENGTHS]
    return [docs, docs[1:]]


def packed_and_grads(model, batch, weights, params):
    """Each document's packed logits (the training forward) and the gradients of Σ <w, logits>."""
    logits = model.lm_head(final_hidden(model, batch.input_ids, batch.position_ids))
    spans = [(r, s, e) for r in range(len(batch.cu_seqlens))
             for s, e in zip(batch.cu_seqlens[r].tolist(), batch.cu_seqlens[r].tolist()[1:])][:len(weights)]
    pieces = [logits[r, s:e] for r, s, e in spans]
    grads = torch.autograd.grad(sum((p * w).sum() for p, w in zip(pieces, weights)), params, allow_unused=True)
    return [p.detach() for p in pieces], [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def largest_difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


#: The hybrid linear-attention families: their packed isolation (fp32 and bf16, forward and
#: gradients) is proven in tests/integration/test_hybrid_packing.py; their compiled layers are not
#: run on the CPU (the per-document path recompiles for every document length there).
HYBRIDS = ("olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(HYBRIDS)))
def test_packed_documents_equal_alone_and_compiled_layers_agree(family):
    model = tiny(family)
    assert type(model).__name__ == CLASSES[family] and packing_isolation(model).isolates
    docs = [d for row in rows() for d in row if d.input_ids]
    batch = collate(rows(), pad_id=0, seq_len=WIDTH)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(len(d.input_ids), VOCAB, generator=g) for d in docs]
    packed, g_packed = packed_and_grads(model, batch, weights, params)
    alone = [model(input_ids=torch.tensor([d.input_ids]), use_cache=False).logits[0] for d in docs]
    g_alone = torch.autograd.grad(sum((a * w).sum() for a, w in zip(alone, weights)), params, allow_unused=True)
    g_alone = [torch.zeros_like(p) if x is None else x for p, x in zip(params, g_alone)]
    scale = max(1.0, max(float(x.abs().max()) for x in g_alone))
    assert largest_difference(packed, [a.detach() for a in alone]) < 1e-5
    assert largest_difference(g_packed, g_alone) < 1e-5 * scale
    if varlen_suits(model.config) is None:  # "auto" takes the packed-attention kernel on CUDA: its CPU reference
        varlen = build_model(config=family_table(family, max_position_embeddings=128), attn_implementation="varlen")
        varlen.load_state_dict(model.state_dict())
        on_varlen, g_varlen = packed_and_grads(varlen.eval(), batch, weights,
                                               [p for p in varlen.parameters() if p.requires_grad])
        assert largest_difference(on_varlen, packed) < 1e-5
        assert largest_difference(g_varlen, g_packed) < 1e-5 * scale
    assert compile_layers(model, backend="eager") >= 2
    compiled, g_compiled = packed_and_grads(model, batch, weights, params)
    assert largest_difference(compiled, packed) < 1e-5
    assert largest_difference(g_compiled, g_packed) < 1e-5 * scale


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_chat_masks_train_exactly_the_answers(family):
    tokens, template = TEMPLATES[family]
    assert trained_runs(family_tokenizer(tokens, template), PLAIN) == ANSWERS[template]


def test_a_template_that_ends_a_turn_with_nothing_is_refused():
    """GLM-4.5's own shape: the next role token ends a turn, so nothing would teach the model to
    stop; refused naming the template (the shipped ``glm4`` ends each turn with an end-of-reply id)."""
    from pgs.errors import DataError
    from pgs.runtime.data import encode_chat

    with pytest.raises(DataError, match="glm4_moe.jinja writes nothing after an assistant turn's text"):
        encode_chat(family_tokenizer("glm4", "glm4_moe"), PLAIN)


def _model_table(family: str, vocab: int) -> str:
    table = family_table(family, vocab_size=None, max_position_embeddings=128)
    if "vocab_size_per_layer_input" in table:  # Gemma 4's per-layer embeddings cover the vocabulary
        table["vocab_size_per_layer_input"] = vocab
    return "[model.config]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())


def _tensor_names(folder) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            names.update(handle.keys())
    return names


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_run_packed_with_gradient_release_exports_what_the_family_reloads(family, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pgs.cli import main

    vocab = len(AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer"))
    spec = cpu_spec(tmp_path, model=_model_table(family, vocab))
    text = spec.read_text().replace("steps = 1\n", "steps = 2\n").replace("export = false", "export = true")
    spec.write_text(text + "\n[optimizer]\nclip = 0.0\n\n[memory]\ngradient_release = true\n")
    assert main(["run", str(spec)]) == 0, capsys.readouterr().err
    losses = [r["loss"] for r in step_records(tmp_path / "run") if "loss" in r]
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", output_loading_info=True)
    assert type(model).__name__ == CLASSES[family]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # the layout transformers saves the family in (a mixture of experts: one tensor per expert)
    model.save_pretrained(tmp_path / "resaved")
    assert _tensor_names(tmp_path / "run" / "final") == _tensor_names(tmp_path / "resaved")
    prompt = torch.tensor([[5, 6, 7]])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (1, 7) and out[0, :3].tolist() == [5, 6, 7]


def _vision_language_checkpoint(folder):
    """A tiny random Qwen3.5 vision-language checkpoint (``model_type: qwen3_5``, the text model
    under ``model.language_model``, a one-block vision tower under ``model.visual``)."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = family_table("qwen3_5_text", vocab_size=485, pad_token_id=0, eos_token_id=2)
    text.pop("model_type")
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(folder)
    return Qwen3_5ForConditionalGeneration


def test_a_vision_language_checkpoint_keeps_its_shape(tmp_path):
    """Trained as its text model, exported with its vision tower untouched, its model_type,
    architecture and weight names: the original's class loads it, every weight found."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from pgs.runtime.store.export import export_hf

    original = tmp_path / "vl"
    cls = _vision_language_checkpoint(original)
    model = build_model(path=str(original))
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.config.model_type == "qwen3_5_text"
    with torch.no_grad():  # what training would do to the text model
        for p in model.parameters():
            p.add_(0.01)
    export_hf(model, AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer"), str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == "qwen3_5" and saved["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert saved["vision_config"] == json.loads((original / "config.json").read_text())["vision_config"]
    with safe_open(original / "model.safetensors", "pt") as a, safe_open(tmp_path / "out" / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        vision = [k for k in a.keys() if k.startswith("model.visual.")]
        assert vision and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in vision)
    reloaded, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    trained = model.state_dict()
    for name, tensor in reloaded.model.language_model.state_dict().items():
        torch.testing.assert_close(tensor, trained["model." + name], rtol=0, atol=0)


def test_a_vision_language_checkpoint_whose_text_has_no_place_is_refused_at_validate(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from helpers import cli_error

    original = tmp_path / "vl"
    _vision_language_checkpoint(original)
    tensors = load_file(original / "model.safetensors")  # the text model renamed out of its place
    save_file({k.replace("language_model.layers.", "language_model.blocks."): v for k, v in tensors.items()},
              original / "model.safetensors", metadata={"format": "pt"})
    spec = cpu_spec(tmp_path, model=f'path = "{original.as_posix()}"')
    capsys.readouterr()
    code, line = cli_error(["validate", str(spec)], capsys)
    assert code == 2 and "is a vision-language checkpoint" in line and "'model.layers.0." in line, line


def test_a_gemma3_vision_language_checkpoint_trains_its_text_and_keeps_its_tower(tmp_path, capsys):
    """transformers loads a Gemma 3 vision-language checkpoint whole: ``pgs run`` (packed, weight
    decay on) trains its language model, leaves its vision tower and projector frozen, and
    exports a folder ``Gemma3ForConditionalGeneration`` loads, the tower bit for bit as it was."""
    from safetensors import safe_open
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from pgs.cli import main

    text = family_table("gemma3_text", vocab_size=485, pad_token_id=0, eos_token_id=2, bos_token_id=None)
    text.pop("model_type")
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    torch.manual_seed(0)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=480,
                          boi_token_index=481, eoi_token_index=482)
    Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path / "vl")
    spec = cpu_spec(tmp_path, model=f'path = "{(tmp_path / "vl").as_posix()}"')
    text = spec.read_text().replace("steps = 1\n", "steps = 2\n").replace("export = false", "export = true")
    spec.write_text(text + '\n[optimizer]\nalias = "adamw"\nargs = { weight_decay = 0.1 }\n')
    assert main(["run", str(spec)]) == 0, capsys.readouterr().err
    out = tmp_path / "run" / "final"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    with safe_open(tmp_path / "vl" / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())  # the checkpoint's own names (language_model.model.…)
        tower = [k for k in a.keys() if not k.startswith("language_model.")]
        assert tower and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in tower)
        changed = [k for k in a.keys() if k.startswith("language_model.model.layers.")
                   and not torch.equal(a.get_tensor(k), b.get_tensor(k))]
        assert changed
    reloaded, info = Gemma3ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_attention_choices_that_would_fail_mid_run_are_made_or_refused_up_front(tmp_path, capsys):
    """GPT-OSS has no SDPA path in transformers: ``"auto"`` takes eager, ``"sdpa"`` is one line at
    validate; a Mistral window keeps ``"auto"`` off the varlen kernel (which has no windows)."""
    from helpers import cli_error
    from pgs.runtime.model.attention import hf_implementation
    from pgs.runtime.model.build import build_config

    assert hf_implementation("auto", build_config(family_table("gpt_oss"))) == "eager"
    assert "sliding-window" in varlen_suits(build_config(family_table("mistral")))
    unwindowed = build_config(family_table("mistral"))
    unwindowed.sliding_window = None  # Mistral 7B v0.3's and Small's config.json
    assert varlen_suits(unwindowed) is None
    spec = cpu_spec(tmp_path, model='attn_implementation = "sdpa"\n' + _model_table("gpt_oss", 485))
    code, line = cli_error(["validate", str(spec)], capsys)
    assert code == 2 and line.startswith('pgs: error: model.attn_implementation: "sdpa": GptOssForCausalLM has no SDPA'), line
