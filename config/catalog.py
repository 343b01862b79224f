"""The registry of named profiles (hardware, models, links, empirical profiles) loaded from presets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar

from config.errors import ConfigError
from config.hardware import HardwareProfile
from config.link import LinkProfile
from config.model import ModelProfile
from config.profile import EmpiricalProfile
from config.yamlio import read_yaml, validate

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
CATALOG_FILES = {"hardware.yaml", "models.yaml", "links.yaml", "profiles.yaml", "tiers.yaml"}

T = TypeVar("T", HardwareProfile, ModelProfile, LinkProfile, EmpiricalProfile)


@dataclass(frozen=True)
class Registry(Generic[T]):
    """Profiles of one kind by name. Lookup of an unknown name lists the known ones."""

    kind: str
    items: dict[str, T] = field(default_factory=dict)

    def get(self, name: str) -> T:
        try:
            return self.items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r} (known: {', '.join(sorted(self.items))})") from None

    def __contains__(self, name: object) -> bool:
        return name in self.items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.items))

    def names(self) -> list[str]:
        return sorted(self.items)


@dataclass(frozen=True)
class Catalog:
    """Every named profile the cluster spec may refer to."""

    hardware: Registry[HardwareProfile]
    models: Registry[ModelProfile]
    links: Registry[LinkProfile]
    profiles: Registry[EmpiricalProfile]

    @staticmethod
    def load(directory: Path = PRESETS_DIR) -> Catalog:
        return Catalog(
            hardware=_inherit_efficiency(_load_registry(directory / "hardware.yaml", "hardware", HardwareProfile),
                                         directory / "hardware.yaml"),
            models=_load_registry(directory / "models.yaml", "model", ModelProfile),
            links=_load_registry(directory / "links.yaml", "link", LinkProfile),
            profiles=_load_registry(directory / "profiles.yaml", "empirical profile", EmpiricalProfile),
        )

    def has_model(self, name: str) -> bool:
        """A cluster engine may name either an architecture (``models``) or an empirical profile."""
        return name in self.models or name in self.profiles


def _load_registry(path: Path, kind: str, cls: type[T]) -> Registry[T]:
    data = read_yaml(path)
    if not isinstance(data, dict) or set(data) != {"items"} or not isinstance(data["items"], list):
        raise ConfigError(str(path), [("", "a catalog file holds one key, 'items', a list of profiles")])
    items: dict[str, T] = {}
    problems: list[tuple[str, str]] = []
    for i, raw in enumerate(data["items"]):
        try:
            obj = validate(cls, raw, source=str(path), prefix=f"items[{i}]")
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        if obj.name in items:
            problems.append((f"items[{i}].name", f"duplicate {kind} name {obj.name!r}"))
        items[obj.name] = obj
    if problems:
        raise ConfigError(str(path), problems)
    return Registry(kind, items)


def _inherit_efficiency(reg: Registry[HardwareProfile], path: Path) -> Registry[HardwareProfile]:
    """Resolve ``efficiency_from``: copy the named profile's fitted efficiency, saying where it came from."""
    items = dict(reg.items)
    problems = []
    for i, (name, hw) in enumerate(reg.items.items()):
        src_name = hw.efficiency_from
        if src_name is None:
            continue
        src = reg.items.get(src_name)
        if src is None or src.efficiency_from is not None:
            problems.append((f"items[{i}].efficiency_from",
                             f"{src_name!r} is not a hardware profile with efficiencies of its own"))
            continue
        if src.architecture != hw.architecture:
            problems.append((f"items[{i}].efficiency_from",
                             f"{src_name!r} is {src.architecture}, {name!r} is {hw.architecture}: borrow "
                             f"efficiencies from a calibrated part of the same architecture family"))
            continue
        eff = src.efficiency.model_copy(update={"fitted_on": f"inherited from {src_name} ({src.efficiency.fitted_on})"})
        if hw.allreduce_from is not None:
            link_src = reg.items.get(hw.allreduce_from)
            if (link_src is None or link_src.efficiency_from is not None
                    or link_src.intra_node_link != hw.intra_node_link):
                problems.append((f"items[{i}].allreduce_from",
                                 f"{hw.allreduce_from!r} is not a calibrated part with a {hw.intra_node_link} link"))
                continue
            eff = eff.model_copy(update={"allreduce": link_src.efficiency.allreduce,
                                         "fitted_on": f"{eff.fitted_on}; all-reduce from {hw.allreduce_from}"})
        items[name] = hw.model_copy(update={"efficiency": eff})
    if problems:
        raise ConfigError(str(path), problems)
    return Registry(reg.kind, items)


@cache
def default_catalog() -> Catalog:
    """The catalog of the presets shipped in ``config/presets`` (loaded once per process)."""
    return Catalog.load(PRESETS_DIR)


def catalog_from_context(context: Any) -> Catalog:
    if isinstance(context, dict) and isinstance(context.get("catalog"), Catalog):
        return context["catalog"]
    return default_catalog()
