"""The main job's model and data under Lightning's own config system, LightningCLI: the suite's callbacks are
``trainer.callbacks`` entries of a YAML file, ``class_path`` and ``init_args``, like any Lightning callback.

    python examples/cli.py fit --config examples/cli/budget.yaml          # budget, selective saves, offload
    python examples/cli.py fit --config examples/cli/layer_offload.yaml   # LoRA base streamed layer by layer
    python examples/cli.py fit --config examples/cli/budget.yaml --print_config   # every argument, resolved

jsonargparse checks each argument against the callbacks' type hints before anything is built; the suite's own
checks (a budget it cannot read, an offload target without checkpointing...) raise ``ConfigError`` when the
callbacks are built, also before any training step: ``lightning_ac.cli.LightningCLI`` (Lightning's, with that) prints
its message and exits with status 2, as jsonargparse does for its own. Needs ``pip install "jsonargparse[signatures]"``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import List, Optional

import lightning.pytorch as pl
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lm import CausalLM, build_model, make_dataloader  # noqa: E402

from lightning_ac.cli import LightningCLI  # noqa: E402  (Lightning's, a ConfigError shown as an error: exit 2)

# peft asks transformers for this deprecated property when wrapping a model: noise for the user, not ours.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


class TinyCausalLM(CausalLM):
    """The main job's model (conf/model/llama.yaml), random init, with a LoRA adapter unless ``lora_r`` is 0.

    Args:
        family: A transformers model type (``llama``, ``qwen3``, ``gemma3_text``...).
        hidden_size: The hidden size.
        intermediate_size: The MLP's inner size.
        num_hidden_layers: Decoder layers.
        num_attention_heads: Attention heads.
        num_key_value_heads: Key/value heads.
        lora_r: LoRA rank on every projection (0: train the whole model).
        lr: AdamW's learning rate.
    """

    def __init__(
        self,
        family: str = "llama",
        hidden_size: int = 256,
        intermediate_size: int = 688,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        lora_r: int = 16,
        lr: float = 3e-3,
    ) -> None:
        config = {
            "vocab_size": 256,  # byte tokens
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        }
        model_cfg = OmegaConf.create({"family": family, "attn_implementation": "sdpa", "config": config})
        targets: List[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora_cfg = OmegaConf.create(
            {"enabled": lora_r > 0, "r": lora_r, "alpha": 2 * lora_r, "dropout": 0.0, "target_modules": targets}
        )
        super().__init__(build_model(model_cfg, lora_cfg), lr=lr)
        self.save_hyperparameters()


class DocstringText(pl.LightningDataModule):
    """The main job's data: byte windows of the docstrings that ship with Python.

    Args:
        seq_len: Tokens per sequence.
        batch_size: Sequences per batch.
        seed: The shuffle's seed.
    """

    def __init__(self, seq_len: int = 256, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def train_dataloader(self) -> DataLoader:
        data = OmegaConf.create({"seq_len": self.seq_len, "batch_size": self.batch_size})
        return make_dataloader(data, vocab_size=256, seed=self.seed)


def main(args: Optional[List[str]] = None) -> LightningCLI:
    """Parse ``args`` (the command line by default), build the model, data, trainer and callbacks, and run."""
    return LightningCLI(TinyCausalLM, DocstringText, seed_everything_default=0, save_config_callback=None, args=args)


if __name__ == "__main__":
    main()
