"""What a replica imports before it can serve: torch's compiler stack (torch._dynamo, inductor) costs
about 1.5 s of CPU at every start and no engine path uses it."""
from __future__ import annotations

import subprocess
import sys


def test_the_serving_path_does_not_import_torch_compile():
    code = ("import sys\n"
            "from chatloom.engine import LLMEngine\n"
            "from chatloom.engine.structured import guide\n"
            "from chatloom.serving.local import LocalBackend\n"
            "from chatloom.serving.replica_server import create_replica_app\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"CHATLOOM_RUNTIME__KERNELS": "0", **__import__("os").environ})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
