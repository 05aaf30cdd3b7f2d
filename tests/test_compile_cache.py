"""The compilation clock behind ``time/compile`` and the persistent-cache switch."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp

from rstarjax.io import compile_cache


def test_compile_seconds_counts_a_new_program_and_not_a_cached_call():
    compile_cache.compile_seconds()  # starts listening
    f = jax.jit(lambda x: jnp.sin(x) @ x.T + 3.0)
    x = jnp.ones((64, 64))
    before = compile_cache.compile_seconds()
    f(x).block_until_ready()
    compiled = compile_cache.compile_seconds() - before
    assert compiled > 0
    again = compile_cache.compile_seconds()
    f(x).block_until_ready()  # same shapes: no compilation
    assert compile_cache.compile_seconds() == again


def _in_fresh_process(body: str, env_extra: dict | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(env_extra or {})
    code = "import jax\nfrom rstarjax.io import compile_cache\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env, timeout=120).stdout.strip()


def test_persistent_cache_is_set_off_or_left_to_the_user(tmp_path):
    target = tmp_path / "xla"
    out = _in_fresh_process(f"""
        print(compile_cache.enable_persistent_cache({str(target)!r}))
        print(jax.config.jax_compilation_cache_dir)""")
    assert out.splitlines() == [str(target), str(target)] and target.is_dir()
    assert _in_fresh_process("""
        print(repr(compile_cache.enable_persistent_cache("")))
        print(repr(jax.config.jax_compilation_cache_dir))""").splitlines() == ["''", "None"]
    mine = tmp_path / "mine"  # the user's own choice wins
    out = _in_fresh_process(f"print(compile_cache.enable_persistent_cache({str(target)!r}))",
                            {"JAX_COMPILATION_CACHE_DIR": str(mine)})
    assert out == str(mine)


def test_an_unusable_directory_compiles_without_a_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert _in_fresh_process(f"""
        print(repr(compile_cache.enable_persistent_cache({str(blocker / "xla")!r})))
        print(repr(jax.config.jax_compilation_cache_dir))""").splitlines() == ["''", "None"]
