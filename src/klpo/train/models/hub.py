"""Model and data set ids on the Hugging Face Hub: fetched as transformers and datasets fetch them.

A name that is not a local path is a Hub id, downloaded into (or read from) the Hugging Face
cache by the libraries themselves, under their own switches:

- ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``): models, tokenizers and data sets come from
  the local cache only;
- ``HF_DATASETS_OFFLINE``: the same for data sets alone (set to ``0`` it lets data sets download
  under ``HF_HUB_OFFLINE=1``, as the ``datasets`` library reads it).

Before anything loads, :func:`hub_problem` says in one short request why an id cannot be had:
offline and not in the cache, the Hub unreachable (a refused or unresolved connection fails in
about a second, a silent network after ``PROBE_TIMEOUT`` seconds; the libraries themselves
would retry for tens of seconds), or no such repository. The test suite runs offline by these
variables.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

__all__ = ["PROBE_TIMEOUT", "hub_problem", "offline", "offline_variable"]

Kind = Literal["model", "dataset"]

PROBE_TIMEOUT = 8.0
"""Seconds the reachability probe waits for the Hub's answer."""

_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's and datasets' spelling of "set"


def _is_set(name: str) -> bool:
    return os.environ.get(name, "").upper() in _TRUE


def offline(kind: Kind) -> bool:
    """Whether the library that fetches a ``kind`` works from the local cache only, as that
    library decides it (read when it was imported, from the variables above)."""
    from huggingface_hub import constants

    if kind == "dataset":
        import datasets.config

        return bool(datasets.config.HF_HUB_OFFLINE)
    return bool(constants.HF_HUB_OFFLINE)


def offline_variable(kind: Kind) -> str:
    """The variable that makes (or would make) ``kind`` offline, for messages."""
    if kind == "dataset" and "HF_DATASETS_OFFLINE" in os.environ:
        return "HF_DATASETS_OFFLINE"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _is_set(name):
            return name
    return "HF_HUB_OFFLINE"


def _cached(name: str, kind: Kind) -> bool:
    """Whether ``name`` has anything in the Hugging Face cache (a model's config.json, or a
    data set's repository folder)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if kind == "model":
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    folder = "datasets--" + name.replace("/", "--")
    return os.path.isdir(os.path.join(constants.HF_HUB_CACHE, folder))


@functools.lru_cache(maxsize=64)
def _probe(name: str, kind: Kind) -> str | None:
    """One request for the repository's metadata: None if it is there, else why not."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    api = HfApi()
    info = api.dataset_info if kind == "dataset" else api.model_info
    try:
        info(name, timeout=PROBE_TIMEOUT)
    except GatedRepoError:
        return None  # the download says how to get access
    except RepositoryNotFoundError:
        return (
            f"the Hub has no {kind} {name!r} (or it is private: log in with `hf auth login` "
            "or set HF_TOKEN)"
        )
    except HfHubHTTPError as err:
        return f"the Hub answered {str(err).splitlines()[0][:160]}"
    except Exception as err:  # the transport's errors: refused, unresolved, timed out
        return f"the Hub could not be reached ({type(err).__name__}: {str(err)[:120]})"
    return None


def hub_problem(name: str, key: str, kind: Kind) -> str | None:
    """Why the Hub id ``name`` (config key ``key``) cannot be loaded now, or None if it can.

    Offline, it must be in the local cache; online, the Hub must answer for it (one request,
    at most :data:`PROBE_TIMEOUT` seconds; a cached copy is not used silently when the Hub is
    unreachable, since the libraries would first retry for tens of seconds).
    """
    var = offline_variable(kind)
    if offline(kind):
        if _cached(name, kind):
            return None
        return (
            f"{key} {name!r}: no such local path, and {kind} id {name!r} is not in the Hugging "
            f"Face cache while {var}=1 keeps the Hub offline; unset {var} to let it be "
            f"downloaded, or give a local {'directory' if kind == 'model' else 'file or directory'}"
        )
    problem = _probe(name, kind)
    if problem is None:
        return None
    cached = _cached(name, kind)
    return f"{key} {name!r}: no such local path, and {problem}. " + (
        f"A copy is in the local cache: set {var}=1 to use it offline"
        if cached
        else f"Check the id and the network, or give a local directory ({var}=1 reads "
        "the local cache only)"
    )
