"""How a folder says which kind of distilled draft it holds: a marker file each kind writes.

Its own module, below both the loader (specdec/model/loading.py, which resolves a model spec to a
pruned or feature draft's folder) and the drafts themselves (pruned.py, feature_draft.py, which
read the target's files through the loader), so neither has to import the other to ask.
"""

from __future__ import annotations

import pathlib

PRUNED_MARKER = "specdec_draft.json"  # a pruned-vocabulary draft (specdec/model/pruned.py)
FEATURE_MARKER = "specdec_feature_draft.json"  # a feature draft (specdec/model/feature_draft.py)


def is_pruned_draft(folder: str | pathlib.Path) -> bool:
    return (pathlib.Path(folder) / PRUNED_MARKER).is_file()


def is_feature_draft(folder: str | pathlib.Path) -> bool:
    return (pathlib.Path(folder) / FEATURE_MARKER).is_file()
