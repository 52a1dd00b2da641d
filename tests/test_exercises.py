"""course.lessons.exercises tells a finished exercise from nbgrader's stub, for functions and for classes."""
from course.lessons.exercises import demo_needs, is_unfinished


def stub(x):
    """What nbgrader leaves of an answer."""
    raise NotImplementedError()


def done(x):
    """A finished answer."""
    return x + 1


class StubClass:
    """An exercise that asks for a class: nbgrader leaves each method's body as a stub."""

    def __init__(self, x):
        raise NotImplementedError()

    def step(self):
        raise NotImplementedError()


class DoneClass:
    def __init__(self, x):
        self.x = x

    def step(self):
        return self.x


def test_functions_values_and_classes():
    assert is_unfinished(stub) and not is_unfinished(done)
    assert is_unfinished(None) and not is_unfinished(3.0)
    assert is_unfinished(StubClass) and not is_unfinished(DoneClass)


def test_demo_needs_names_the_unfinished_class(capsys):
    assert not demo_needs(StubClass, done)
    assert "Finish the exercise `StubClass` to see this." in capsys.readouterr().out
    assert demo_needs(DoneClass, done)
