"""The guide's helpers: job entry, backends, measurements, plots.

DeepSpeed JIT-builds its CPU ops into ``$TORCH_EXTENSIONS_DIR``; torch's default,
``~/.cache/torch_extensions``, is shared by every checkout of a user. Two checkouts (two
``.venv`` paths) compile different command lines into the same build directory, so each
rebuilds the op (a minute or more, inside a job) whenever a job of the other ran in between.
Unless it is set, each checkout builds into its own ``build/torch_extensions`` (git ignores it).
"""

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(CHECKOUT / "build" / "torch_extensions"))
