"""The LightningModule the break-it tests of ``chunked_loss: auto`` and ``tiled_mlp: auto`` train: a tiny Llama whose
vocabulary of 8,000 makes the output head most of a step's activations (``tests/test_budget_tools_edge_*.py``)."""

from __future__ import annotations

import lightning as L
import torch
from transformers import AutoModelForCausalLM, LlamaConfig


class VocabLM(L.LightningModule):
    """Four layers, hidden 64, a vocabulary of 8,000; batches of 2 x 128 tokens; the model's own loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(
            LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=8000,
            )
        )
        self.model.train()

    def training_step(self, b, i):
        return self.model(input_ids=b, labels=b).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.randint(0, 8000, (16, 128), generator=g), batch_size=2)
