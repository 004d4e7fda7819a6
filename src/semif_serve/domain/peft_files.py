"""How PEFT saves a LoRA adapter, spelled once: the files of an adapter directory (a lev release
holds the same two) and the prefix of every saved tensor's name."""

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)
PEFT_PREFIX = "base_model.model."  # PEFT's saved keys: base_model.model.<module>.lora_A.weight
