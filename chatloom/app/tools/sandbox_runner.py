"""Runs inside the code interpreter's sandbox (app/tools/sandbox.py), never imported by the server.

Reads the model's code from stdin and runs it like a notebook cell: a last line that is an expression
has its value printed. Then every open matplotlib figure is saved as a PNG under /mnt/plots, so a
plot appears in the chat without the code saving it. Only the standard library is used here: the
interpreter inside may have nothing else.
"""
import ast
import os
import sys
import traceback

PLOTS = "/mnt/plots"


def _run(source: str) -> int:
    try:
        tree = ast.parse(source, "<code>", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        return 1
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(tree, "<code>", "exec"), scope)
        if last is not None:
            value = eval(compile(last, "<code>", "eval"), scope)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        kind, value, tb = sys.exc_info()
        traceback.print_exception(kind, value, tb.tb_next if tb is not None else None)
        return 1
    finally:
        _save_figures()
    return 0


def _save_figures() -> None:
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    try:
        for n, number in enumerate(pyplot.get_fignums(), 1):
            pyplot.figure(number).savefig(os.path.join(PLOTS, f"figure-{n}.png"), format="png", dpi=100)
    except Exception as exc:  # a figure that cannot be drawn is reported, the run's output kept
        print(f"could not save the figures: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # -I leaves the scratch folder off the path: its modules may be imported
    sys.stdout.reconfigure(errors="replace")
    sys.stderr.reconfigure(errors="replace")
    code = sys.stdin.read()
    sys.stdout.flush()
    sys.exit(_run(code))
