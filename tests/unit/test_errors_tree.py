"""Every error class of splitfeed hangs off trainer_client.contract.errors.SplitfeedError and is drawn there."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import splitfeed
from splitfeed.trainer_client.contract import errors


PACKAGES = ("trainer_client", "sidecar", "operator", "local")


def error_classes() -> dict[str, type[BaseException]]:
    """Exception classes defined in splitfeed's modules, by their dotted name below `splitfeed.`."""
    found: dict[str, type[BaseException]] = {}
    for package in PACKAGES:
        root = importlib.import_module(f"splitfeed.{package}")
        names = [f"splitfeed.{package}"] + [
            m.name for m in pkgutil.walk_packages(root.__path__, f"splitfeed.{package}.")]
        for name in names:
            module = importlib.import_module(name)
            for _, value in inspect.getmembers(module, inspect.isclass):
                if issubclass(value, BaseException) and value.__module__ == name:
                    found[f"{name.removeprefix('splitfeed.')}.{value.__qualname__}"] = value
    return found


def test_the_search_finds_the_errors_of_every_package():
    names = set(error_classes())
    assert {"trainer_client.contract.errors.ProtocolError", "sidecar.world.checkpoints.StaleWorld",
            "operator.cluster.kube.Conflict", "local.rescaling._EndedFirst"} <= names, names


def test_every_error_class_subclasses_the_root_and_is_drawn_in_its_docstring():
    doc = errors.__doc__ or ""
    for dotted, cls in error_classes().items():
        assert issubclass(cls, errors.SplitfeedError), f"{dotted} does not subclass SplitfeedError"
        drawn = cls.__name__ if dotted.startswith("trainer_client.contract.errors.") else dotted
        assert f" {drawn} " in doc or f" {drawn}\n" in doc, f"{dotted} is not drawn in trainer_client/contract/errors.py"


def test_the_drawing_names_no_class_that_does_not_exist():
    classes = error_classes()
    drawn = {word for line in (errors.__doc__ or "").splitlines()
             for word in line.replace("─", " ").replace("│", " ").split()
             if word[:1].isalpha() and (word.endswith(("Error", "Failed", "Unavailable")) or "." in word)
             and word[0].isalpha() and word.split(".")[0] in PACKAGES}
    assert drawn <= set(classes), drawn - set(classes)
