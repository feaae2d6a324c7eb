"""Key tables read from a framework's source (klpo.doctor.tables.class_keys, argparse_flags).

The walker is checked on a made-up source whose keys are written out by hand: base classes'
fields first, a field typed as another class (or built by its default_factory) walked into,
unions of classes (every variant's keys, the default's class winning a shared key), type
aliases, mapping-typed fields as open sections, a class of another package as open, and a
class name defined in two files resolved in the referring class's own file. With a checkout of
a framework named in ``KLPO_FRAMEWORK_SRC`` (``roll=/path/to/ROLL,areal=...``), the shipped
table is regenerated from it and compared key for key.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from klpo.doctor import tables
from klpo.doctor.reading import known_key

CONFIG = """
from dataclasses import dataclass, field
from typing import Annotated, Dict, Optional, TypeAlias, Union
from pydantic import BaseModel, Field
from elsewhere import RendererConfig

@dataclass
class Base:
    seed: int = 42
    name: str = field(default="run")

@dataclass
class Optim:
    lr: float = 1e-6
    betas: tuple = (0.9, 0.99)

class LossA(BaseModel):
    type: str = "a"
    tau: float = Field(1e-3, ge=0)

class LossB(BaseModel):
    type: str = "b"
    threshold: float = 0.2

Loss: TypeAlias = Annotated[LossA | LossB, Field(discriminator="type")]

@dataclass
class Config(Base):
    optim: Optim = field(default_factory=Optim)
    critic: Optional[Optim] = None
    loss: Loss = LossA()
    env: Dict[str, str] = field(default_factory=dict)
    renderer: RendererConfig = None
    model: "Model" = None
    groups: Union[int, None] = 1
"""
OTHER = """
from pydantic import BaseModel

class Model(BaseModel):
    path: str = "m"

class Unused(BaseModel):
    x: int = 1
"""
SHADOW = """
from pydantic import BaseModel

class Model(BaseModel):
    wrong: int = 0
"""


def test_class_keys_by_hand(tmp_path):
    (tmp_path / "config.py").write_text(textwrap.dedent(CONFIG))
    (tmp_path / "model.py").write_text(textwrap.dedent(OTHER))
    (tmp_path / "shadow.py").write_text(textwrap.dedent(SHADOW))
    # config.py names Model without defining it: the first file that defines it is model.py.
    files = [tmp_path / "config.py", tmp_path / "model.py", tmp_path / "shadow.py"]
    keys = tables.class_keys(files, "Config")
    assert keys == {
        "seed": 42,
        "name": "run",
        "optim.lr": 1e-6,
        "optim.betas": [0.9, 0.99],
        "critic.lr": 1e-6,
        "critic.betas": [0.9, 0.99],
        "loss.type": "a",  # LossA, the default's class, wins the shared key
        "loss.tau": 1e-3,
        "loss.threshold": 0.2,  # LossB's own key: any variant's keys are known
        "env": {},
        "renderer": {},
        "model.path": "m",
        "groups": 1,
    }
    assert known_key("env.ANY_NAME", keys) and known_key("renderer.anything", keys)
    assert not known_key("optim.lr_typo", keys) and not known_key("model.wrong", keys)


def test_a_class_defined_twice_resolves_in_its_own_file(tmp_path):
    (tmp_path / "a.py").write_text(
        "from pydantic import BaseModel\nclass Model(BaseModel):\n    a: int = 1\n"
        "class Top(BaseModel):\n    model: Model = Model()\n"
    )
    (tmp_path / "b.py").write_text(
        "from pydantic import BaseModel\nclass Model(BaseModel):\n    b: int = 2\n"
        "class Other(BaseModel):\n    model: Model = Model()\n"
        "class Root(BaseModel):\n    top: 'Top' = None\n    other: Other = Other()\n"
    )
    keys = tables.class_keys([tmp_path / "b.py", tmp_path / "a.py"], "Root")
    assert keys == {"top.model.a": 1, "other.model.b": 2}


def test_argparse_flags_by_hand(tmp_path):
    (tmp_path / "args.py").write_text(
        "def add(parser):\n"
        "    parser.add_argument('--kl-coef', type=float, default=0.0)\n"
        "    parser.add_argument('--use-kl-loss', action='store_true')\n"
        "    for name in ['a', 'b']:\n"
        "        parser.add_argument(f'--{name}-size', type=int, default=4)\n"
    )
    assert tables.argparse_flags([tmp_path / "args.py"]) == {
        "a-size": 4,
        "b-size": 4,
        "kl-coef": 0.0,
        "use-kl-loss": False,
    }


def _sources() -> dict[str, str]:
    given = os.environ.get("KLPO_FRAMEWORK_SRC", "")
    return dict(p.split("=", 1) for p in given.split(",") if "=" in p)


@pytest.mark.parametrize("framework", sorted({*tables.SOURCE_TABLES, *tables.ARGPARSE_TABLES}))
def test_the_shipped_key_table_is_the_sources(framework):
    root = _sources().get(framework)
    if root is None:
        pytest.skip(f"peer test: set KLPO_FRAMEWORK_SRC={framework}=/path/to/its/checkout")
    fresh = tables.source_table(framework, Path(root))
    shipped = json.loads((tables.TABLES / f"{framework}-{fresh['version']}.json").read_text())
    assert fresh["defaults"] == shipped["defaults"]


def test_every_source_table_is_shipped():
    for framework in {*tables.SOURCE_TABLES, *tables.ARGPARSE_TABLES}:
        spec = tables.SOURCE_TABLES.get(framework) or tables.ARGPARSE_TABLES[framework]
        shipped = tables.load(framework, spec[0])
        assert shipped.defaults, framework
