"""Random-weight Qwen3.5 checkpoints and a Qwen-style tokenizer, built offline and deterministically.

The demo service, the tests and the benchmarks load these through the production loader,
so the hybrid cache, the shared prefix path and the readout all run for real.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DEMO_REVISION = "demo-random-weights-v1"

# Qwen2/3's pre-tokenizer split: keeps "\n\n" and a following letter in separate pieces.
QWEN_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Qwen3-style template: honours enable_thinking=False with an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Text the demo tokenizer's merges are learnt from: the prompt's fixed wording and common English.
_TRAINING_TEXT = """
Apply the supplied criterion to the supplied evidence. Choose exactly one listed option.
Respond with only its uppercase letter, with no explanation or reasoning.
{"evidence": "Health checks passed in all three zones.", "criterion": "Did the deployment
succeed?", "options": [{"letter": "A", "description": "It succeeded."}, {"letter": "B",
"description": "It failed."}]} The ticket mentions a billing error, a refund request and a
password reset. Which queue handles this ticket? The service returned errors for ten minutes
after the release, then recovered. Is the customer asking for a refund? Yes. No. Unclear.
the of and to in is was for on that with as by at from this which are be it an or not
"""


@dataclass(frozen=True)
class CheckpointShape:
    """The geometry of a random-weight Qwen3.5 text model."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_key_head_dim: int = 16
    linear_num_value_heads: int = 4
    linear_value_head_dim: int = 16
    vocab_size: int | None = None  # None: the tokenizer's size rounded up to 64
    extra: dict = field(default_factory=dict)

    def text_config(self, vocab_size: int) -> dict:
        """Qwen3_5TextConfig keyword arguments: three linear-attention layers per full one."""
        layer_types = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]
        return dict(
            vocab_size=self.vocab_size or vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            layer_types=layer_types,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            linear_num_key_heads=self.linear_num_key_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=4,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            **self.extra,
        )


DEMO_SHAPE = CheckpointShape()
# Real vocabulary and the layer mix at a width where a CPU forward costs real compute.
BENCH_SHAPE = CheckpointShape(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_key_head_dim=64,
    linear_num_value_heads=8,
    linear_value_head_dim=64,
    vocab_size=248320,
)
# Qwen3.5-4B's text geometry, for GPU capacity and latency work without the weights.
QWEN35_4B_SHAPE = CheckpointShape(
    hidden_size=2560,
    intermediate_size=9216,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_num_value_heads=32,
    linear_value_head_dim=128,
    vocab_size=248320,
    extra={"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}},
)


def build_tokenizer(directory: Path, vocab_size: int = 1024):
    """Train a byte-level BPE with Qwen's pre-tokenizer and chat template; save it to `directory`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return fast


def write_checkpoint(
    directory: Path,
    shape: CheckpointShape = DEMO_SHAPE,
    seed: int = 0,
    multimodal: bool = False,
    slot_bias: dict[str, float] | None = None,
) -> Path:
    """Write a random-weight Qwen3.5 checkpoint and tokenizer to `directory`, offline.

    `multimodal` saves a `Qwen3_5ForConditionalGeneration` with a tiny vision tower (the real
    model's layout); `slot_bias` adds a bias to the output rows of the given letters (a planted
    position preference for tests).
    """
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    directory = Path(directory)
    tokenizer = build_tokenizer(directory)
    vocab = -(-len(tokenizer) // 64) * 64
    text = shape.text_config(vocab)
    text.update(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    if multimodal:
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=shape.hidden_size,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
        model: Qwen3_5ForConditionalGeneration | Qwen3_5ForCausalLM = Qwen3_5ForConditionalGeneration(config)
        embed = model.model.language_model.embed_tokens
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
        embed = model.model.embed_tokens
    model.eval()
    if slot_bias:
        with torch.no_grad():
            # Tied embeddings: a letter's logit is its row dotted with the last position's final
            # hidden state (RMS-normed: norm ~ sqrt(hidden_size)). Every prompt ends with "\n", and
            # in a random-weight model that state points along the "\n" embedding, so moving the
            # letter's row along it raises the logit by about `bias`. (A fixed direction such as
            # all-ones has a seed-dependent sign: with seed 0 it lowered the logit instead.)
            newline = embed.weight[tokenizer.convert_tokens_to_ids("\u010a")].clone()
            direction = newline / newline.norm()
            for letter, bias in slot_bias.items():
                token_id = tokenizer.convert_tokens_to_ids(letter)
                embed.weight[token_id] += bias * direction / shape.hidden_size**0.5
    model.save_pretrained(str(directory))
    (directory / "DEMO.json").write_text(
        json.dumps({"random_weights": True, "revision": DEMO_REVISION, "seed": seed}) + "\n"
    )
    return directory
