"""The main job with fmoe's adapters: ``python -m interop.train`` takes every setting of
``python -m fmoe.train`` and adds the two that need ``interop``:

    python -m interop.train --device cuda --dtype bfloat16 --capacity-factor 1.25 --cuda-graph attn,experts
    torchrun --nproc-per-node 8 -m interop.train --config mixtral-small --expert-backend te

``--cuda-graph`` captures the step with its update, or its layer scopes (``interop.cuda_graph``);
``--expert-backend te`` runs the experts on TransformerEngine (``interop.te``, imported
only when asked for, since it loads TransformerEngine).
"""

from __future__ import annotations

import importlib

from fmoe import train
from fmoe.trainer.setup import Adapters

from .cuda_graph import CaptureError, GraphedTrainStep, capture_scopes, check_capturable


def load_backend(module: str) -> None:
    """Import ``module`` (``interop.te``), which registers the expert backend it
    declares. Without TransformerEngine the import still succeeds and the backend's
    check says so."""
    importlib.import_module(module)


ADAPTERS = Adapters(check_capturable, GraphedTrainStep, capture_scopes, load_backend, CaptureError)


def main(argv=None) -> dict:
    """``fmoe.train.main`` with the adapters handed in; returns its summary."""
    return train.main(argv, ADAPTERS)


if __name__ == "__main__":
    main()
