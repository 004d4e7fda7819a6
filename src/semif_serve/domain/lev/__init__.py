"""lev's method as lev's server reads a release, a module per job: its vocabulary (`types`), the
manifest and flags (`release`), the temperatures (`calibration`), the codes and router (`routing`),
the prompt (`prompt`), the plan and readout (`readout`).

lev is Qwen3.5 with a LoRA adapter, a candidate head ("Mode B") and per-bucket temperatures
(GitHub `Abhinavexists/lev`, Apache-2.0). Every rule here was read from its source; `docs/lev.md`
names the file each came from. The code is this project's own. Nothing here knows torch or a
tokenizer: the engine hands in which codes are one token (`LevCodes`) and the scores it read.
"""
