"""ModelRegistry: names, aliases, conflicts, not found; the backend factory."""

from __future__ import annotations

import pytest

from backends.registry import BackendSpec, create_backend
from routing import ModelNotFound, ModelRegistry
from tests.gateway.echo_backend import EchoBackend


def test_resolve_names_and_aliases() -> None:
    registry = ModelRegistry()
    a, b = EchoBackend(name="a"), EchoBackend(name="b")
    registry.add("a", a, aliases=["alpha", "a", "alpha"])
    registry.add("b", b)
    assert registry.resolve("alpha").name == "a"
    assert registry.resolve("a").aliases == ("alpha",)
    assert [d.backend for d in registry.resolve("b").deployments] == [b]
    assert registry.resolve("b").router.deployments[0].name == "b"
    assert [m.name for m in registry.models()] == ["a", "b"]
    assert registry.backends() == [a, b]
    assert registry.sole_model() is None
    assert len(registry) == 2


def test_not_found() -> None:
    registry = ModelRegistry()
    registry.add("a", EchoBackend())
    with pytest.raises(ModelNotFound) as info:
        registry.resolve("A")
    assert "`A` does not exist" in info.value.message
    assert registry.sole_model().name == "a"


@pytest.mark.parametrize(("name", "aliases"), [("a", []), ("b", ["a"]), ("c", ["x"])])
def test_conflicts(name: str, aliases: list[str]) -> None:
    registry = ModelRegistry()
    registry.add("a", EchoBackend(), aliases=["x"])
    with pytest.raises(ValueError, match="already used"):
        registry.add(name, EchoBackend(), aliases=aliases)


def test_shared_backend_listed_once() -> None:
    registry = ModelRegistry()
    shared = EchoBackend()
    registry.add("a", shared)
    registry.add("b", shared)
    assert registry.backends() == [shared]


def test_unknown_backend_kind() -> None:
    with pytest.raises(ValueError, match="not available"):
        create_backend(BackendSpec(name="m", model_id="x", backend="carrier-pigeon"))
