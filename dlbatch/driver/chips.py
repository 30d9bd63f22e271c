"""The chips a run may place workers on, their profiles and the device their workers use.

* **A local run** (``cluster.address`` null): this machine's chips that have a profile
  measured here for the job's model (configs/chips/*.yaml written by ``dlbatch profile``:
  a CPU profile counts as one chip, a CUDA one as the CUDA devices here); with none, the
  CPU as one chip named ``cpu-local``.
* **An attached cluster**: the ``chip:<name>`` resources its nodes declare
  (``ray start --resources='{"chip:h100_sxm": 8}'``), one unit per worker (replica) slot.

A chip's profile (the solver's cost model) is its measured profile file
``configs/chips/<name>.yaml`` for the job's model, else the catalog's entry of that name
(configs/chips/catalog.yaml: datasheet figures); a chip with neither is an error naming it
and how to profile it. The device its workers use comes from the same place (a measured
profile's device, the catalog entry's ``device``).
"""
from __future__ import annotations

import glob
import os

LOCAL_CHIP = "cpu-local"  # this machine's CPU, when no profile measured here names it otherwise
RESOURCE_PREFIX = "chip:"


class NoChipProfile(ValueError):
    """A chip the layout would use has no profile (measured or in the catalog)."""


def chips_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "configs", "chips")


def catalog_file() -> str:
    return os.path.join(chips_dir(), "catalog.yaml")


def _yaml(path: str):
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None


def default_chip_files(model_name: str) -> list[str]:
    """The catalog plus every measured profile in configs/chips/ made for ``model_name``."""
    files = [catalog_file()] if os.path.isfile(catalog_file()) else []
    for f in sorted(glob.glob(os.path.join(chips_dir(), "*.yaml"))):
        data = _yaml(f) if f != catalog_file() else None
        if isinstance(data, dict) and data.get("source") == "measured" and data.get("model") in (model_name, "", None):
            files.append(f)
    return files


def local_available(chip_files: list[str]) -> dict[str, int]:
    """This machine's chips that have a measured profile among `chip_files`: a profile
    measured on the CPU counts as one chip (it was measured with every core), one measured
    on CUDA as the number of CUDA devices here."""
    out: dict[str, int] = {}
    for f in chip_files:
        data = _yaml(f)
        if not isinstance(data, dict) or data.get("source") != "measured" or not data.get("name"):
            continue
        device = str((data.get("measured") or {}).get("device", ""))
        if device == "cpu":
            out[data["name"]] = 1
        elif device.startswith("cuda"):
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count():
                out[data["name"]] = torch.cuda.device_count()
    return out


def local_chips(model_name: str) -> dict[str, int]:
    """The chips of a local run: profiles measured here for the model, else this CPU."""
    return local_available(default_chip_files(model_name)) or {LOCAL_CHIP: 1}


def cluster_chips(resources: dict) -> dict[str, int]:
    """``chip:<name>`` resources of a Ray cluster (`ray.cluster_resources()`) -> name -> slots."""
    return {k[len(RESOURCE_PREFIX):]: int(v) for k, v in sorted(resources.items())
            if k.startswith(RESOURCE_PREFIX) and int(v) >= 1}


def _measured(name: str, model_name: str) -> dict | None:
    data = _yaml(os.path.join(chips_dir(), f"{name}.yaml"))
    if isinstance(data, dict) and data.get("source") == "measured" and data.get("model") in (model_name, "", None):
        return data
    return None


def _catalog_entry(name: str):
    from dlbatch.solver.catalog import load_catalog

    return load_catalog(catalog_file()).get(name) if os.path.isfile(catalog_file()) else None


def _missing(name: str, model_name: str) -> NoChipProfile:
    return NoChipProfile(
        f"chip {name!r} (Ray resource {RESOURCE_PREFIX}{name}) has no profile for model {model_name!r}: "
        f"measure one on a node with that chip (`dlbatch profile --name {name} --model {model_name} --device cuda` "
        f"writes configs/chips/{name}.yaml) or add {name!r} to {catalog_file()}")


def chip_device(name: str, model_name: str) -> str:
    """The device kind the workers on chip ``name`` use ("cpu", "cuda", ...)."""
    data = _measured(name, model_name)
    if data is not None:
        return str((data.get("measured") or {}).get("device", "cpu")).split(":")[0]
    entry = _catalog_entry(name)
    if entry is not None:
        return entry.device
    if name == LOCAL_CHIP:
        return "cpu"
    raise _missing(name, model_name)


def chip_profiles(names, model) -> dict:
    """name -> `ChipProfile` of each chip for ``model`` (a solver `ModelSpec`): measured
    first, else the catalog's roofline profile."""
    from dlbatch.solver.catalog import to_profile
    from dlbatch.solver.profile import load_profile

    out = {}
    for name in names:
        if _measured(name, model.name) is not None:
            out[name] = load_profile(os.path.join(chips_dir(), f"{name}.yaml"))
            continue
        entry = _catalog_entry(name)
        if entry is None:
            raise _missing(name, model.name)
        out[name] = to_profile(entry, model)
    return out
