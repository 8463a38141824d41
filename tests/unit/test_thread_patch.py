"""Thread-local patches: seen by the patching thread only, undone once no thread is inside."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from p2pweights.thread_patch import patched_call, patched_flag, unpatched


def _module() -> Any:
    module = types.ModuleType("fake_sglang_module")
    module.answer = lambda: "original"  # type: ignore[attr-defined]
    module.flag = False  # type: ignore[attr-defined]
    return module


def _from_thread(call: Any) -> Any:
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(call()))
    thread.start()
    thread.join()
    return seen[0]


def test_only_the_patching_thread_sees_the_replacement() -> None:
    module = _module()
    original = module.answer
    with patched_call(module, "answer", lambda: "patched"), patched_flag(module, "flag", True):
        assert module.answer() == "patched" and bool(module.flag)
        assert _from_thread(lambda: (module.answer(), bool(module.flag))) == ("original", False)
        assert unpatched(module, "answer") is original
    assert module.answer is original and module.flag is False


def test_nested_patches_unwind_in_order() -> None:
    module = _module()
    with patched_call(module, "answer", lambda: "outer"):
        with patched_call(module, "answer", lambda: "inner"):
            assert module.answer() == "inner"
        assert module.answer() == "outer"
    assert module.answer() == "original"


def test_the_original_comes_back_when_the_last_thread_leaves() -> None:
    module = _module()
    original = module.answer
    inside, leave = threading.Event(), threading.Event()
    seen: list[str] = []

    def other() -> None:
        with patched_call(module, "answer", lambda: "other"):
            inside.set()
            leave.wait()
            seen.append(module.answer())

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait()
    with patched_call(module, "answer", lambda: "mine"):
        assert module.answer() == "mine"
    assert module.answer() == "original"  # the other thread is still inside
    assert module.answer is not original
    leave.set()
    thread.join()
    assert seen == ["other"]
    assert module.answer is original


def test_restored_on_error() -> None:
    module = _module()
    original = module.answer
    with pytest.raises(RuntimeError), patched_call(module, "answer", lambda: "patched"):
        raise RuntimeError("inside")
    assert module.answer is original


def test_a_replacement_made_by_somebody_else_meanwhile_is_kept() -> None:
    module = _module()

    def theirs() -> str:
        return "theirs"

    with patched_call(module, "answer", lambda: "patched"):
        module.answer = theirs
    assert module.answer is theirs


def test_an_inherited_class_attribute_is_not_left_on_the_subclass() -> None:
    class Base:
        def name(self) -> str:
            return "base"

    class Child(Base):
        pass

    with patched_call(Child, "name", lambda self: "patched"):
        assert Child().name() == "patched"
        assert _from_thread(lambda: Child().name()) == "base"
    assert "name" not in vars(Child)
