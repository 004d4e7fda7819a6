"""The `images` phase of gpu_run: what an image costs at Qwen3.5-4B's real vision geometry.

A random-weight vision tower at the geometry of Qwen3.5-4B's `vision_config` is built on the
device in BF16 and joined to the run's text model (its weights shared, not copied) as a
`Qwen3_5ForConditionalGeneration`. Through the engine's image building blocks
(`semif_serve.engine.vision`), for images of several sizes after the processor's resize:

- the vision tower's weights (bytes), each image's patches, tokens, tower time and peak memory;
- one question over a state with the image vs the same state without it;
- eight questions about the image in one forward vs one question (goal <= 1.5x);
- a second question over the kept image state (its suffix only) vs the first (goal >= 5x);
- the image path's readout against a full forward of the vision-language model on the whole
  prompt (the model places the features and computes its own 3-D positions).

Then the same through the service's own path (`EngineBench`): a `TorchEngine` built as the
loader builds one for a vision-language checkpoint (its text side from `loader.text_side`, a
`VisionTower`, a state cache, the run's memory view and headroom less the tower's weights),
asked through `TorchEngine.read(RowsRequest.of(..., images=[...]))`: the first question (cache cleared), eight
questions in one request, a second question over the cached image state, the tower's peak
through `ImageSet.features` vs `VisionTower.activation_bytes`, and every answer against the
full forward. The issue's two goals are gated on these, the service's numbers.

Random weights cost what the real ones cost in time and memory; the answers mean nothing.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from harness.geometry import QWEN35_4B_VISION

from . import image_reference
from .common import Gate

# tools/demo.py's multimodal checkpoint: the tiny tower the tests run.
DEMO_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
VISION_GEOMETRY = {"4b": QWEN35_4B_VISION, "demo": DEMO_VISION}
IMAGE_SIZES = {
    "4b": ((448, 448), (1024, 768), (1920, 1080)),
    "demo": ((40, 24), (64, 48), (96, 64)),
}
PLACEHOLDER = "<image:photo>"
STATE = {"photo": PLACEHOLDER, "caption": "A photo of the shipment as it arrived at the dock."}
TEXT_STATE = {"caption": STATE["caption"]}  # the same state without its image
QUESTIONS = [
    ("Is the package damaged?", ["Yes, visibly damaged.", "No, it looks intact."]),
    ("What is the package made of?", ["Cardboard.", "Plastic.", "Wood."]),
    ("Is a shipping label visible?", ["Yes.", "No."]),
    ("How many packages are shown?", ["One.", "Two.", "More than two."]),
    ("Is the photo taken indoors?", ["Indoors.", "Outdoors."]),
    ("Is the package open?", ["Open.", "Closed."]),
    ("Which colour dominates the photo?", ["Brown.", "White.", "Another colour."]),
    ("Should the shipment be refused?", ["Refuse it.", "Accept it.", "Inspect it first."]),
]
EIGHT_VS_ONE_GOAL = 1.5
SECOND_VS_FIRST_GOAL = 5.0
READOUT_MAX_GAP = 0.10  # as gpu_run's parity gate: option probabilities, BF16
KEPT_STATE_MAX_GAP = 1e-3  # the same suffix over a copy of the same state
# The engine's answers compared with the full forward: question 0 alone, all eight, question 1 cached.
ENGINE_GAPS = ("first_vs_full_forward_gap", "eight_vs_full_forward_gap", "second_vs_full_forward_gap")
MAX_INPUT_TOKENS = 32_768  # well past the largest image's prompt (1920 x 1080: ~2,100 tokens)


def vision_language_model(text_model: Any, vision: dict[str, Any], tensor_device: str, seed: int = 0) -> Any:
    """`text_model` (a Qwen3_5ForCausalLM) inside a Qwen3_5ForConditionalGeneration whose vision
    tower of geometry `vision` is created on the device in BF16 with random weights; the text
    weights are the text model's own tensors (shared: no second copy on the device)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    text = text_model.config
    config = Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config={**vision, "out_hidden_size": text.hidden_size},
        tie_word_embeddings=text.tie_word_embeddings,
    )
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    model.model.language_model = text_model.model
    model.lm_head = text_model.lm_head
    torch.manual_seed(seed)
    with torch.device(tensor_device):
        model.model.visual = Qwen3_5VisionModel._from_config(config.vision_config, dtype=torch.bfloat16)
    model.eval()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")
    return model


def synthetic_png(width: int, height: int, seed: int) -> bytes:
    """A PNG of `width` x `height`: a colour gradient with noise (the pixels only cost time)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([255 * x / max(1, width - 1), 255 * y / max(1, height - 1), np.full_like(x, 128)], -1)
    pixels = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


@dataclass
class Timer:
    """Median wall time of a device computation over `repeats` runs after one warm-up."""

    synchronize: Callable[[], None]
    repeats: int = 3

    def __call__(self, run: Callable[[], Any]) -> tuple[float, Any]:
        out = run()
        self.synchronize()
        times = []
        for _ in range(self.repeats):
            started = time.perf_counter()
            out = run()
            self.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times), out


class ImageBench:
    """The measurements over one vision-language model, its tokenizer and the run's device."""

    def __init__(self, model: Any, tokenizer: Any, cuda: Any, tensor_device: str, repeats: int = 3) -> None:
        from semif_serve.domain.prompt import PromptCodec
        from semif_serve.engine import vision

        self.model = model
        self.tokenizer = tokenizer
        self.cuda = cuda
        self.tensor_device = tensor_device
        self.codec = PromptCodec(tokenizer)
        self.vision = vision
        self.processor = vision.image_processor(model.config)
        self.merge = model.config.vision_config.spatial_merge_size
        self.pad = tokenizer.convert_tokens_to_ids(vision.IMAGE_PAD)
        self.timer = Timer(lambda: cuda.synchronize(), repeats)

    # -- prompts

    def rows(self, state: Any, tokens: Sequence[int]) -> list[list[int]]:
        """Each question's prompt ids over `state`, every image pad expanded to its tokens."""
        out = []
        for question, options in QUESTIONS:
            text = self.codec.render_prompt(state, question, options)
            ids = self.codec.encode(text.replace(PLACEHOLDER, self.vision.VISION_BLOCK))
            out.append(image_reference.expand_image_pads(ids, self.pad, tokens))
        return out

    def letters(self, n: int) -> list[int]:
        return [self.tokenizer.convert_tokens_to_ids(c) for c in self.codec.codes[:n]]

    def probabilities(self, logits: Any, question: int) -> list[float]:
        """The option letters' probabilities of one question, from its row's logits."""
        letters = self.letters(len(QUESTIONS[question][1]))
        return [float(p) for p in logits[letters].float().softmax(-1)]

    # -- the pieces

    def on_device(self, pixels: Any) -> Any:
        """The processor's output with its tensors on the device, as the tower needs them."""
        return self.vision.PixelInputs(
            pixels.pixel_values.to(self.tensor_device),
            pixels.grid_thw.to(self.tensor_device),
            pixels.tokens,
        )

    def state(self, prefix: Sequence[int], features: Sequence[Any], grid: Any) -> tuple[Any, int]:
        """The prefilled one-row cache of `prefix` (its images' features placed) and the offset."""
        embeds = image_reference.prefix_embeddings(self.model, prefix, self.pad, features)
        positions, offset = image_reference.rope_positions(self.model, prefix, self.pad, grid)
        return image_reference.prefill_embeddings(self.model, embeds, positions), offset

    def readout(self, cache: Any, n_prefix: int, offset: int, suffixes: Sequence[Sequence[int]]) -> Any:
        """Float32 logits of each suffix over a copy of `cache` (the kept state is unchanged)."""
        from semif_serve.engine.state_cache import fork_cache

        return image_reference.suffix_logits_after_images(
            self.model, fork_cache(cache, len(suffixes)), n_prefix, offset, suffixes, 0
        )

    def peak(self, run: Callable[[], Any]) -> tuple[int, Any]:
        """Bytes `run` allocates on the device at its peak, over what was allocated before."""
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()
        before = int(self.cuda.memory_allocated())
        out = run()
        self.cuda.synchronize()
        return int(self.cuda.max_memory_allocated()) - before, out

    def full_forward(self, ids: Sequence[int], pixels: Any) -> Any:
        """The last position's logits of one forward of the whole model on the whole prompt."""
        import torch

        tensor = torch.tensor([list(ids)], device=self.tensor_device)
        with torch.inference_mode():
            out = self.model(
                input_ids=tensor,
                pixel_values=pixels.pixel_values,
                image_grid_thw=pixels.grid_thw,
                mm_token_type_ids=(tensor == self.pad).int(),
                logits_to_keep=1,
            )
        return out.logits[0, -1].float()

    # -- one image size

    def measure(
        self, width: int, height: int, seed: int = 0, engine: EngineBench | None = None
    ) -> dict[str, Any]:
        """One image size through the building blocks (and through `engine`, where given, after
        them: the tower is then warm at this size)."""
        from semif_serve.domain.images import read_image

        data = synthetic_png(width, height, seed)
        asset = read_image(PLACEHOLDER, data, claimed="png", max_pixels=width * height)
        started = time.perf_counter()
        host = self.vision.preprocess(self.processor, [asset], self.merge)
        preprocess_s = time.perf_counter() - started
        pixels = self.on_device(host)
        (t, h, w) = (int(v) for v in host.grid_thw[0].tolist())
        patch = self.model.config.vision_config.patch_size

        tower_bytes, _ = self.peak(lambda: image_reference.image_features(self.model, pixels))
        tower_s, features = self.timer(lambda: image_reference.image_features(self.model, pixels))

        rows = self.rows(STATE, host.tokens)
        n = common_prefix(rows)
        prefix, suffixes = rows[0][:n], [r[n:] for r in rows]
        text_rows = self.rows(TEXT_STATE, ())
        m = common_prefix(text_rows)
        text_prefix, text_suffixes = text_rows[0][:m], [r[m:] for r in text_rows]

        prefill_bytes, (cache, offset) = self.peak(lambda: self.state(prefix, features, host.grid_thw))
        prefill_s, (cache, offset) = self.timer(lambda: self.state(prefix, features, host.grid_thw))
        one_s, one = self.timer(lambda: self.readout(cache, n, offset, suffixes[:1]))
        eight_s, eight = self.timer(lambda: self.readout(cache, n, offset, suffixes))
        text_prefill_s, (text_cache, text_offset) = self.timer(
            lambda: self.state(text_prefix, [], host.grid_thw[:0])
        )
        text_one_s, _ = self.timer(lambda: self.readout(text_cache, m, text_offset, text_suffixes[:1]))
        again = self.readout(cache, n, offset, suffixes[:1])  # the second question over the kept state

        first_s = tower_s + prefill_s + one_s
        expected = self.full_forward(rows[0], pixels)
        probabilities = self.probabilities(one[0], 0)
        row = {
            "width": width,
            "height": height,
            "image_bytes": len(data),
            "resized": [w * patch, h * patch],  # width x height after the processor's resize
            "grid_thw": [t, h, w],
            "patches": t * h * w,
            "image_tokens": host.tokens[0],
            "prefix_tokens": n,
            "text_prefix_tokens": m,
            "rope_offset": offset,
            "preprocess_seconds": preprocess_s,
            "tower_seconds": tower_s,
            "tower_peak_bytes": tower_bytes,
            "prefill_seconds": prefill_s,
            "prefill_peak_bytes": prefill_bytes,
            "one_question_seconds": first_s,
            "without_image_seconds": text_prefill_s + text_one_s,
            "eight_questions_seconds": tower_s + prefill_s + eight_s,
            "second_question_seconds": one_s,
            "image_vs_none": first_s / (text_prefill_s + text_one_s),
            "eight_vs_one": (tower_s + prefill_s + eight_s) / first_s,
            "first_vs_second": first_s / one_s,
            "readout_vs_full_forward_gap": max_gap(probabilities, self.probabilities(expected, 0)),
            "eight_rows_vs_one_gap": max_gap(probabilities, self.probabilities(eight[0], 0)),
            "kept_state_gap": max_gap(probabilities, self.probabilities(again[0], 0)),
            "probabilities": probabilities,
        }
        if engine is not None:
            try:
                row["engine"] = engine.measure(asset, rows, pixels)
            except Exception as exc:  # noqa: BLE001 - e.g. an OOM the estimate let in: recorded, gated
                row["engine"] = {"failed": f"{type(exc).__name__}: {exc}"[:1000]}
                self.cuda.empty_cache()
        return row


class EngineBench:
    """The same image through the service's path: `TorchEngine.read` over a vision-language
    engine (`service_engine`), timed, its tower's peak against its own estimate, and each
    answer against the blocks' full forward of the same prompt."""

    def __init__(self, engine: Any, blocks: ImageBench) -> None:
        from semif_serve.domain.types import PromptRow

        self.engine = engine
        self.blocks = blocks
        self.questions = [PromptRow(q, tuple(o)) for q, o in QUESTIONS]
        self.tower_runs = 0
        self._hook = blocks.model.model.visual.register_forward_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.tower_runs += 1

    def close(self) -> None:
        """Unhook the tower and drop the engine's states (their device memory goes now)."""
        self._hook.remove()
        self.engine.cache.clear()

    def ask(self, state: Any, first: int, count: int, images: Sequence[Any], cold: bool = True) -> Any:
        """One request of `count` questions from question `first` (the cache cleared if `cold`)."""
        from semif_serve.domain.requests import RowsRequest

        if cold:
            self.engine.cache.clear()
        return self.engine.read(
            RowsRequest.of(
                state,
                self.questions[first : first + count],
                shared=True,
                max_input_tokens=MAX_INPUT_TOKENS,
                images=images,
            )
        )

    def runs_of(self, ask: Callable[[], Any]) -> tuple[int, Any]:
        """How many times the vision tower ran during `ask`, and its readout."""
        before = self.tower_runs
        out = ask()
        return self.tower_runs - before, out

    def measure(self, asset: Any, block_rows: Sequence[Sequence[int]], pixels: Any) -> dict[str, Any]:
        from semif_serve.domain.requests import RowsRequest
        from semif_serve.domain.types import TooLargeForMemory

        engine, blocks, timer = self.engine, self.blocks, self.blocks.timer
        prepared = engine.vision.prepare([asset])
        image = next(iter(prepared.images.values()))
        estimate = engine.vision.activation_bytes(image.patches, engine.estimate)
        try:
            prompts = engine.prepare(
                RowsRequest.of(
                    STATE, self.questions, shared=True, max_input_tokens=MAX_INPUT_TOKENS, images=[asset]
                )
            ).prompts
        except TooLargeForMemory as exc:  # the service would answer 413: recorded, gated
            return {"refused": str(exc), "patches": image.patches, "tower_estimate_bytes": estimate}
        ids = [[t if t >= 0 else blocks.pad for t in p.ids] for p in prompts]
        prepared.preprocess()
        tower_bytes, _ = blocks.peak(lambda: prepared.features(image.key))

        without_s, _ = timer(lambda: self.ask(TEXT_STATE, 0, 1, []))
        first_s, first = timer(lambda: self.ask(STATE, 0, 1, [asset]))
        eight_s, eight = timer(lambda: self.ask(STATE, 0, len(QUESTIONS), [asset]))
        self.ask(STATE, 0, 1, [asset])  # the image's state, cached for the second question
        second_s, second = timer(lambda: self.ask(STATE, 1, 1, [asset], cold=False))
        first_runs, _ = self.runs_of(lambda: self.ask(STATE, 0, 1, [asset]))
        second_runs, _ = self.runs_of(lambda: self.ask(STATE, 1, 1, [asset], cold=False))

        expected = [blocks.probabilities(blocks.full_forward(r, pixels), i) for i, r in enumerate(ids)]
        return {
            "grid_thw": list(image.grid_thw),
            "patches": image.patches,
            "image_tokens": image.tokens,
            "prompts_match_blocks": ids == [list(r) for r in block_rows],
            "input_tokens": [r.input_tokens for r in eight.rows],
            "prefix_tokens": first.timing.prefix_tokens,
            "tower_peak_bytes": tower_bytes,
            "tower_estimate_bytes": estimate,
            "tower_measured_vs_estimate": tower_bytes / estimate,
            "without_image_seconds": without_s,
            "first_question_seconds": first_s,
            "eight_questions_seconds": eight_s,
            "second_question_seconds": second_s,
            "image_vs_none": first_s / without_s,
            "eight_vs_one": eight_s / first_s,
            "first_vs_second": first_s / second_s,
            "first_prefill": first.timing.prefill,
            "second_prefill": second.timing.prefill,
            "eight_forward_batches": eight.timing.forward_batches,
            "tower_runs_first": first_runs,
            "tower_runs_second": second_runs,
            "first_vs_full_forward_gap": max_gap(first.rows[0].probabilities, expected[0]),
            "eight_vs_full_forward_gap": max(
                max_gap(r.probabilities, e) for r, e in zip(eight.rows, expected, strict=True)
            ),
            "second_vs_full_forward_gap": max_gap(second.rows[0].probabilities, expected[1]),
            "probabilities": [r.probabilities for r in eight.rows],
        }


def service_engine(model: Any, tokenizer: Any, base: Any) -> Any:
    """A `TorchEngine` over the vision-language `model` as `load_model` and startup give one for
    a checkpoint with a vision tower: the loader's text side, a `VisionTower`, `base`'s identity,
    memory view and prefill chunk, a state cache of `base`'s budget and `base`'s headroom less
    the tower's weights (they were not in the base's baseline)."""
    from transformers import Qwen3_5ForCausalLM

    from semif_serve.engine.loader import text_side
    from semif_serve.engine.runner import TorchEngine
    from semif_serve.engine.state_cache import StateCache
    from semif_serve.engine.vision import VisionTower

    tower = sum(p.numel() * p.element_size() for p in model.model.visual.parameters())
    headroom = None if base.headroom_bytes is None else base.headroom_bytes - tower
    options = replace(base.options, headroom_bytes=headroom, cache=StateCache(base.cache.budget_bytes))
    return TorchEngine(
        text_side(model, Qwen3_5ForCausalLM),
        base.codec,
        base.identity,
        options,
        VisionTower(model, tokenizer),
    )


def measure_images(
    model: Any,
    tokenizer: Any,
    cuda: Any,
    tensor_device: str,
    sizes: Sequence[tuple[int, int]],
    keep_going: Callable[[], bool] = lambda: True,
    repeats: int = 3,
    engine: Any | None = None,
) -> dict[str, Any]:
    """The image phase's data: the tower's geometry and weights, and one row per image size (a
    size the deadline leaves no time for is recorded as skipped); with `engine` (the service's
    text engine) each row also holds the same image through a vision-language engine built
    over `model` as the loader builds one (`service_engine`), under "engine"."""
    visual = model.model.visual
    bench = ImageBench(model, tokenizer, cuda, tensor_device, repeats)
    served = None if engine is None else EngineBench(service_engine(model, tokenizer, engine), bench)
    rows: list[dict[str, Any]] = []
    try:
        for k, (width, height) in enumerate(sizes):
            if not keep_going():
                rows.append({"width": width, "height": height, "skipped": "deadline"})
                continue
            rows.append(bench.measure(width, height, seed=k, engine=served))
    finally:
        if served is not None:
            served.close()
    config = model.config.vision_config
    return {
        "vision_config": {
            key: getattr(config, key)
            for key in (
                "depth",
                "hidden_size",
                "intermediate_size",
                "num_heads",
                "patch_size",
                "spatial_merge_size",
                "temporal_patch_size",
                "out_hidden_size",
                "num_position_embeddings",
            )
        },
        "vision_parameters": sum(p.numel() for p in visual.parameters()),
        "vision_weights_bytes": sum(p.numel() * p.element_size() for p in visual.parameters()),
        "processor": type(bench.processor).__name__,
        "repeats": repeats,
        "engine_headroom_bytes": None if served is None else served.engine.headroom_bytes,
        "engine_prefill_chunk_tokens": None if served is None else served.engine.prefill_chunk_tokens,
        "rows": rows,
    }


def image_gates(data: dict[str, Any]) -> list[Gate]:
    """Every size measured; the blocks read as the full forward, eight rows and a kept state
    read as one fresh row; the service's engine answers every size, as the full forward, its
    second question from the cached state without the tower, its tower within its estimate;
    the issue's two goals (eight vs one, second vs first) on the engine's numbers."""
    rows = [r for r in data["rows"] if "skipped" not in r]
    skipped = len(data["rows"]) - len(rows)
    served = [r for r in rows if engine_problem(r) is None]

    def each(key: str, over: Sequence[dict[str, Any]] | None = None) -> str:
        return "; ".join(
            f"{r['width']}x{r['height']}: {value(r, key):.3g}" for r in (rows if over is None else over)
        )

    def value(row: dict[str, Any], key: str) -> Any:
        head, _, tail = key.partition(".")
        return row[head][tail] if tail else row[head]

    def engine_all(test: Callable[[dict[str, Any]], bool]) -> bool:
        return bool(rows) and len(served) == len(rows) and all(test(r["engine"]) for r in served)

    unserved = [f"{r['width']}x{r['height']}: {engine_problem(r)}" for r in rows if r not in served]
    full_gap = {id(r): max(r["engine"][k] for k in ENGINE_GAPS) for r in served}
    below = [f"{r['width']}x{r['height']}" for r in served if r["engine"]["tower_measured_vs_estimate"] > 1]
    return [
        Gate(
            "image sizes measured",
            bool(rows) and not skipped,
            f"{len(rows)}/{len(data['rows'])}" + (f", {skipped} skipped (deadline)" if skipped else ""),
        ),
        Gate(
            "image path vs full forward",
            all(r["readout_vs_full_forward_gap"] <= READOUT_MAX_GAP for r in rows),
            f"max probability gap {each('readout_vs_full_forward_gap')} (limit {READOUT_MAX_GAP})",
        ),
        Gate(
            "eight rows read as one",
            all(r["eight_rows_vs_one_gap"] <= READOUT_MAX_GAP for r in rows),
            f"gap {each('eight_rows_vs_one_gap')} (limit {READOUT_MAX_GAP})",
        ),
        Gate(
            "kept image state reads as fresh",
            all(r["kept_state_gap"] <= KEPT_STATE_MAX_GAP for r in rows),
            f"gap {each('kept_state_gap')} (limit {KEPT_STATE_MAX_GAP})",
        ),
        Gate(
            "engine answers every size",
            bool(rows) and not unserved,
            "; ".join(unserved) or f"{len(served)} sizes through TorchEngine.read",
        ),
        Gate(
            "engine vs full forward",
            engine_all(lambda e: e["prompts_match_blocks"])
            and all(full_gap[id(r)] <= READOUT_MAX_GAP for r in served),
            "; ".join(
                f"{r['width']}x{r['height']}: {full_gap[id(r)]:.3g}"
                + ("" if r["engine"]["prompts_match_blocks"] else " (prompt differs from the blocks')")
                for r in served
            )
            + f" (first, eight, second; limit {READOUT_MAX_GAP})",
        ),
        Gate(
            "engine's second question from the cached state",
            engine_all(
                lambda e: (
                    e["second_prefill"] == "cached"
                    and e["tower_runs_second"] == 0
                    and e["first_prefill"] == "fresh"
                    and e["tower_runs_first"] == 1
                )
            ),
            "; ".join(
                f"{r['width']}x{r['height']}: first {r['engine']['first_prefill']} "
                f"(tower x{r['engine']['tower_runs_first']}), second {r['engine']['second_prefill']} "
                f"(tower x{r['engine']['tower_runs_second']})"
                for r in served
            ),
        ),
        Gate(
            "tower estimate covers its peak",
            engine_all(lambda e: e["tower_measured_vs_estimate"] <= 1.0),
            f"measured / estimated {each('engine.tower_measured_vs_estimate', served)}"
            + (f" (the estimate is BELOW the measurement at {', '.join(below)})" if below else ""),
        ),
        Gate(
            "goal: eight questions <= 1.5x one",
            engine_all(lambda e: e["eight_vs_one"] <= EIGHT_VS_ONE_GOAL),
            f"engine {each('engine.eight_vs_one', served)}; blocks {each('eight_vs_one')}",
        ),
        Gate(
            "goal: second question >= 5x faster",
            engine_all(lambda e: e["first_vs_second"] >= SECOND_VS_FIRST_GOAL),
            f"engine {each('engine.first_vs_second', served)}; blocks {each('first_vs_second')}",
        ),
    ]


def image_table(data: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The phase's printed table of the building blocks: one line per image size."""
    head = [
        "image",
        "resized",
        "tokens",
        "tower ms",
        "tower MiB",
        "prefill ms",
        "1 q ms",
        "no image ms",
        "8 q / 1 q",
        "1st / 2nd",
        "gap vs full",
    ]
    body = []
    for r in data["rows"]:
        if "skipped" in r:
            body.append([f"{r['width']}x{r['height']}", "skipped (deadline)", *["-"] * (len(head) - 2)])
            continue
        body.append(
            [
                f"{r['width']}x{r['height']}",
                "x".join(map(str, r["resized"])),
                r["image_tokens"],
                1000 * r["tower_seconds"],
                r["tower_peak_bytes"] / 1024**2,
                1000 * r["prefill_seconds"],
                1000 * r["one_question_seconds"],
                1000 * r["without_image_seconds"],
                r["eight_vs_one"],
                r["first_vs_second"],
                r["readout_vs_full_forward_gap"],
            ]
        )
    return head, body


def engine_table(data: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The phase's printed table of the service's engine: one line per image size."""
    head = [
        "image",
        "1st q ms",
        "no image ms",
        "8 q ms",
        "2nd q ms",
        "8 q / 1 q",
        "1st / 2nd",
        "tower MiB",
        "estimate MiB",
        "meas / est",
        "gap vs full",
    ]
    body = []
    for r in data["rows"]:
        name = f"{r['width']}x{r['height']}"
        e = r.get("engine")
        why = "skipped (deadline)" if "skipped" in r else engine_problem(r)
        if why is not None:
            body.append([name, why[:60], *["-"] * (len(head) - 2)])
            continue
        body.append(
            [
                name,
                1000 * e["first_question_seconds"],
                1000 * e["without_image_seconds"],
                1000 * e["eight_questions_seconds"],
                1000 * e["second_question_seconds"],
                e["eight_vs_one"],
                e["first_vs_second"],
                e["tower_peak_bytes"] / 1024**2,
                e["tower_estimate_bytes"] / 1024**2,
                e["tower_measured_vs_estimate"],
                max(e[k] for k in ENGINE_GAPS),
            ]
        )
    return head, body


def engine_problem(row: dict[str, Any]) -> str | None:
    """Why a measured size has no engine numbers (refused with a 413, failed, not measured)."""
    engine = row.get("engine")
    if engine is None:
        return "not measured"
    return engine.get("refused") or engine.get("failed")


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """How many leading ids every row shares, leaving each at least one id of its own."""
    n = 0
    while all(len(r) > n + 1 for r in rows) and len({r[n] for r in rows}) == 1:
        n += 1
    return n


def max_gap(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
