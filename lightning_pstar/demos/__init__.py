"""Demo model, corpus and LightningModule shared by the examples, benchmarks and tests.

Like ``lightning.pytorch.demos``, this lives inside the package so that no script imports another
script: ``examples/train_gpt.py``, ``benchmarks/overhead.py`` and the tests all import from here.
"""

from lightning_pstar.demos.corpus import VOCAB, CharDataset, StdlibCharDataModule, decode, encode, stdlib_text
from lightning_pstar.demos.gpt import GPT, GPTConfig, gpt_num_params
from lightning_pstar.demos.module import GPTLightningModule

__all__ = [
    "GPT",
    "VOCAB",
    "CharDataset",
    "GPTConfig",
    "GPTLightningModule",
    "StdlibCharDataModule",
    "decode",
    "encode",
    "gpt_num_params",
    "stdlib_text",
]
