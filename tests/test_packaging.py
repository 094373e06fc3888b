"""What users install (issue 15): the sdist, and the wheel built from it.

``python -m build`` (without isolation: the test environment holds the
build-system requirements) builds the sdist from a copy of the source tree,
then the wheel from the unpacked sdist. The wheel packages the kernel that
the install built in this checkout where it is up to date (compiling it
again takes a minute of CI); the slow isolated build compiles it from the
sdist. The wheel must carry every module of the package and the
compiled CPU kernel, be tagged for this interpreter and platform (it holds a
shared library), and its kernel must load, with no compiler on ``PATH``, in a
fresh interpreter that imports optax4bit from the unpacked wheel, and compute
what the jnp path computes. Without the library, or with a broken one, the
package falls back to the jnp path and logs one line.

The slow test builds in a fresh virtual environment with ``build``'s default
isolation (downloads setuptools and jaxlib) and installs the wheel with its
dependencies there. The aarch64 test cross-compiles the kernel's row
functions and runs them under qemu-user, and builds them with Clang where it is
installed; it is skipped where the cross compiler or qemu is absent (Debian:
g++-aarch64-linux-gnu, qemu-user-static; clang).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the sdist is built from (the tests are not part of the package).
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "optax4bit")
KERNEL = "optax4bit/cpu/_kernels" + importlib.machinery.EXTENSION_SUFFIXES[0]
FALLBACK_LOG = "optax4bit runs its jnp path on CPU"


def _modules() -> set:
  """Every module of the package in the source tree, as archive paths."""
  return {p.relative_to(ROOT).as_posix() for p in (ROOT / "optax4bit").rglob("*.py")
          if "__pycache__" not in p.parts}


def _run(cmd, timeout=600, **kwargs) -> subprocess.CompletedProcess:
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                        **kwargs)
  assert proc.returncode == 0, (f"{cmd} exited with {proc.returncode}\nstdout:\n"
                                f"{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}")
  return proc


def _copy_sources(dest: Path) -> Path:
  """`SOURCES` without build products (the build writes into its source tree)."""
  dest.mkdir(parents=True)
  ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.egg-info", "build")
  for name in SOURCES:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    else:
      shutil.copy2(ROOT / name, dest / name)
  return dest


def _build(python, src: Path, out: Path, *flags) -> tuple:
  """``python -m build`` of ``src`` into ``out``: (sdist, wheel)."""
  _run([str(python), "-m", "build", *flags, "--outdir", str(out), str(src)])
  (sdist,) = out.glob("*.tar.gz")
  (wheel,) = out.glob("*.whl")
  return sdist, wheel


def _seed_kernel(src: Path) -> None:
  """Puts the kernel that the install built in this checkout where setuptools'
  ``build_ext`` finds it up to date in ``src``, if it is newer than every
  kernel source: the wheel then packages it rather than compiling it again
  (a minute of CI). The slow isolated build compiles from the sdist."""
  built = ROOT / KERNEL
  sources = [*(ROOT / "optax4bit" / "cpu").glob("*.h"), ROOT / "optax4bit/cpu/kernels.cc",
             ROOT / "setup.py"]
  if not built.is_file() or built.stat().st_mtime < max(p.stat().st_mtime for p in sources):
    return
  lib = src / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / KERNEL
  lib.parent.mkdir(parents=True)
  shutil.copy(built, lib)  # a new mtime: newer than the unpacked sources


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
  """(sdist, wheel): the sdist from a copy of the sources, the wheel from the
  unpacked sdist, with the checkout's kernel (`_seed_kernel`)."""
  base = tmp_path_factory.mktemp("packaging")
  out = base / "dist"
  _run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--outdir", str(out),
        str(_copy_sources(base / "src"))])
  (sdist,) = out.glob("*.tar.gz")
  with tarfile.open(sdist) as tf:
    tf.extractall(base / "unpacked", filter="data")
  (unpacked,) = (base / "unpacked").iterdir()
  _seed_kernel(unpacked)
  _run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(out),
        str(unpacked)])
  (wheel,) = out.glob("*.whl")
  return sdist, wheel


def _unpack(wheel: Path, dest: Path) -> Path:
  with zipfile.ZipFile(wheel) as zf:
    zf.extractall(dest)
  return dest


def test_wheel_is_tagged_for_this_platform_and_holds_the_package(dists):
  from packaging.tags import sys_tags  # pylint: disable=import-outside-toplevel
  from packaging.utils import parse_wheel_filename  # pylint: disable=import-outside-toplevel
  _, wheel = dists
  _, _, _, tags = parse_wheel_filename(wheel.name)
  assert all(t.platform != "any" and t.abi != "none" for t in tags), wheel.name
  assert tags & set(sys_tags()), f"{wheel.name} does not install on this interpreter"
  with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    (info,) = {n.split("/")[0] for n in names if n.endswith(".dist-info/WHEEL")}
    assert "Root-Is-Purelib: false" in zf.read(f"{info}/WHEEL").decode()
    assert KERNEL in names, sorted(names)
    assert "optax4bit/py.typed" in names, "no PEP 561 marker in the wheel"
    assert f"{info}/licenses/LICENSE" in names, sorted(n for n in names if info in n)
    kernel_bytes = zf.getinfo(KERNEL).file_size
  assert not _modules() - names, f"modules missing from the wheel: {_modules() - names}"
  if sys.platform.startswith("linux"):
    # Stripped: 1.39 MB since the stall rule's row functions (issue 50; 0.90 MB before).
    # Unstripped (Python's CFLAGS carry -g) it was 2.7 MB when stripped was 0.24 MB.
    assert kernel_bytes < 2_000_000, f"{KERNEL} is {kernel_bytes} bytes: not stripped?"


def test_sdist_holds_the_kernel_sources(dists):
  sdist, _ = dists
  with tarfile.open(sdist) as tf:
    names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
  sources = {str(p.relative_to(ROOT)) for p in (ROOT / "optax4bit" / "cpu").glob("*")
             if p.suffix in (".cc", ".h")}
  assert "optax4bit/cpu/kernels.cc" in sources
  expected = _modules() | sources | {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md",
                                     "LICENSE", "optax4bit/py.typed"}
  assert not expected - names, f"missing from the sdist: {expected - names}"


# Run in a fresh interpreter that imports optax4bit from argv[1]: one step of
# 4-bit AdamW (both recipes) through the kernel, against the jnp path.
_STEP = r"""
import json, logging, shutil, sys
import jax, jax.numpy as jnp, numpy as np
import optax4bit, optax4bit.cpu
from optax4bit import dispatch
assert optax4bit.__file__.startswith(sys.argv[1]), optax4bit.__file__
out = {"compilers": [c for c in ("cc", "gcc", "c++", "g++", "clang") if shutil.which(c)],
       "available": optax4bit.cpu.available(), "reason": optax4bit.cpu.unavailable_reason(),
       "auto_runs_jnp": dispatch.fused_steps("auto") is None,
       "version": optax4bit.__version__}
params = {"w": 0.02 * jax.random.normal(jax.random.PRNGKey(0), (4, 256))}
grads = {"w": 0.01 * jax.random.normal(jax.random.PRNGKey(1), (4, 256))}
impls = ("jnp", "cpu") if out["available"] else ("jnp", "auto")
for recipe in ("default", "paper"):
  results = []
  for impl in impls:
    tx = optax4bit.adamw_4bit(1e-3, recipe=recipe, min_quantize_size=0, implementation=impl)
    fn = jax.jit(tx.update)
    if impl == "cpu":
      assert "optax4bit_adam_4bit_apply" in fn.lower(grads, tx.init(params), params).as_text()
    u, s = fn(grads, tx.init(params), params)
    results.append([np.asarray(x) for x in jax.tree.leaves((u, s))])
  out[recipe] = all(np.array_equal(a, b) for a, b in zip(*results))
print("RESULTS " + json.dumps(out))
"""


def _step_in_fresh_interpreter(python, site: Path, tmp_path: Path) -> tuple:
  """Runs `_STEP` with optax4bit from ``site``, no compiler on PATH; (results, stderr)."""
  empty = tmp_path / "empty_bin"
  empty.mkdir(exist_ok=True)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
  env.update(PATH=str(empty), CC="/bin/false", CXX="/bin/false", JAX_PLATFORMS="cpu",
             PYTHONPATH=str(site))
  proc = _run([str(python), "-c", _STEP, str(site)], env=env, cwd=tmp_path)
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")]
  return json.loads(line[len("RESULTS "):]), proc.stderr


def test_wheel_kernel_loads_without_a_compiler(dists, tmp_path):
  from packaging.utils import parse_wheel_filename  # pylint: disable=import-outside-toplevel
  site = _unpack(dists[1], tmp_path / "site")
  out, stderr = _step_in_fresh_interpreter(sys.executable, site, tmp_path)
  # __version__ comes from the installed distribution's metadata.
  assert out["version"] == str(parse_wheel_filename(dists[1].name)[1]), out["version"]
  assert out["compilers"] == []
  assert out["available"], out["reason"]
  assert out["default"] and out["paper"], out
  assert FALLBACK_LOG not in stderr


@pytest.mark.parametrize("damage", [pytest.param("absent", marks=pytest.mark.slow),  # CI's time
                                    "broken"])
def test_wheel_without_a_loadable_kernel_runs_jnp_and_logs_once(dists, tmp_path, damage):
  site = _unpack(dists[1], tmp_path / "site")
  kernel = site / KERNEL
  if damage == "absent":
    kernel.unlink()
  else:
    kernel.write_bytes(b"not a shared library")
  out, stderr = _step_in_fresh_interpreter(sys.executable, site, tmp_path)
  expected = "without its compiled CPU kernel" if damage == "absent" else "cannot be loaded"
  assert not out["available"] and expected in out["reason"], out
  assert out["auto_runs_jnp"] and out["default"] and out["paper"], out
  logged = [l for l in stderr.splitlines() if FALLBACK_LOG in l]
  assert len(logged) == 1 and expected in logged[0], stderr


@pytest.mark.slow
def test_isolated_build_in_a_fresh_venv(tmp_path):
  """``python -m build`` with isolation from the repository, in a fresh venv;
  then the wheel installed with its dependencies, run without a compiler."""
  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", str(venv)])
  python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
  _run([str(python), "-m", "pip", "install", "--quiet", "build"])
  _, wheel = _build(python, _copy_sources(tmp_path / "src"), tmp_path / "dist")
  site = tmp_path / "site"
  _run([str(python), "-m", "pip", "install", "--quiet", "--target", str(site), str(wheel)])
  out, _ = _step_in_fresh_interpreter(python, site, tmp_path)
  assert out["compilers"] == [] and out["available"], out
  assert out["default"] and out["paper"], out


# The row functions of one ISA path of the kernel over a 4x256 leaf; prints a hash of
# every output.
_ROWS_CHECK = r"""
// One ISA path's rows over a 4x256 leaf: one stats and one apply pass of 4-bit Adam (StatsRows,
// ApplyRows) per recipe (paper; m stochastic; both moments stochastic), the first-moment rows (FirstMomentRows: momentum, Nesterov momentum,
// factored Adam), the codecs' rows (EncodeBlockRows, EncodeRank1Rows, DecodeRows) and, given
// the 8-bit tables file, 8-bit Adam's rows (Apply8bitRows). Prints an FNV-1a hash of every
// output (update, codes, scales, maxima, decoded values) per case.
// Arguments: the gradient's tiny scale for every seventh element (0, or 1e-36 for subnormals),
// the old block scales (0: the moments' first step), the 8-bit tables file, the ISA path
// (kIsaPaths' name; baseline if not given). Exits with 3 where the path does not run.
#include "optax4bit/cpu/kernels.cc"  // -I the repository root
#include "benchmarks/row_pass_args.h"

#include <cstdio>
#include <cstring>
#include <iterator>

template <typename T>
uint64_t Fnv(uint64_t h, const std::vector<T>& x) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(x.data());
  for (size_t i = 0; i < x.size() * sizeof(T); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

constexpr uint64_t kFnvOffset = 1469598103934665603ull;

// One hash of the bytes of every output, in order.
template <typename... T>
uint64_t Hash(const std::vector<T>&... outputs) {
  uint64_t h = kFnvOffset;
  ((h = Fnv(h, outputs)), ...);
  return h;
}

int Lanes(std::string_view path) {
#ifdef OPTAX4BIT_X86_PATHS
  if (path == "avx512") return avx512::kLanes;
  if (path == "avx2") return avx2::kLanes;
#endif
  return baseline::kLanes;
}

int main(int argc, char** argv) {
  const char* name = argc > 4 ? argv[4] : "baseline";
  size_t p = 0;
  while (p < std::size(kIsaPaths) && std::strcmp(kIsaPaths[p].name, name) != 0) ++p;
  if (p == std::size(kIsaPaths) || !kIsaPaths[p].runs()) {
    std::fprintf(stderr, "%s does not run here\n", name);
    return 3;
  }
  const IsaPath& path = kIsaPaths[p];
  const CodecPath& codec = kCodecPaths[p];
  const float tiny = argc > 1 ? std::strtof(argv[1], nullptr) : 0.0f;
  const float old_scale = argc > 2 ? std::strtof(argv[2], nullptr) : 0.01f;
  const int64_t rows = 4, d = 256, h = d / 2, blocks = h / kBlockBytes;
  uint32_t state = 12345u;
  auto next = [&state] { return state = state * 1664525u + 1013904223u; };
  auto gradient = [&] {
    std::vector<float> g(rows * d);
    for (float& x : g) x = ((next() >> 8) / 16777216.0f - 0.5f) * 0.02f;
    for (int64_t i = 0; i < rows * d; i += 7) g[i] *= tiny;  // subnormal for tiny = 1e-36
    return g;
  };
  auto codes = [&](int64_t n) {
    std::vector<uint8_t> c(n);
    for (uint8_t& x : c) x = next() >> 24;
    return c;
  };
  std::fprintf(stderr, "%s lanes %d\n", name, Lanes(name));
  FlushDenormals flush;
  std::vector<float> scratch(3 * d);
  for (int recipe = 0; recipe < 3; ++recipe) {
    const bool m_stochastic = recipe >= 1, v_stochastic = recipe == 2, v_linear = recipe == 0;
    std::vector<float> g = gradient(), m_scales(rows * blocks, old_scale), v_rows(rows, 1e-4f);
    std::vector<uint8_t> m_codes = codes(rows * h), v_codes = codes(rows * h);
    RowPassArgs args(rows, h, v_linear);
    std::vector<float> v(d), new_m_scales(rows * blocks), row_max(rows);
    std::vector<uint32_t> col_max(d);
    path.stats_rows(args.Stats(g.data(), v_rows.data(), v_codes.data(), row_max.data()), 0,
                    rows, v.data(), col_max.data());
    const ApplyRowsArgs apply = args.Apply(g.data(), v_rows.data(), m_codes.data(),
                                           v_codes.data(), m_scales.data(), new_m_scales.data(),
                                           m_stochastic, v_stochastic);
    path.apply_rows(apply, 0, rows, scratch.data());
    const uint64_t hash = Hash(g, m_codes, v_codes, new_m_scales, row_max, col_max);
    std::printf("adam recipe %d %016llx first update %.9g\n", recipe, (unsigned long long)hash,
                g[0]);
  }
  const FirstMomentStep steps[] = {FirstMomentStep::kMomentum,
                                   FirstMomentStep::kMomentumNesterov,
                                   FirstMomentStep::kFactored};
  for (int k = 0; k < 3; ++k) {
    RowPassArgs args(rows, h, false);
    std::vector<float> g = gradient(), m_scales(rows * blocks, old_scale),
                       new_m_scales(rows * blocks);
    std::vector<uint8_t> m_codes = codes(rows * h);
    path.first_moment_rows(args.FirstMoment(steps[k], g.data(), m_scales.data(),
                                            new_m_scales.data(), m_codes.data(), k != 0),
                           0, rows, scratch.data());
    const uint64_t hash = Hash(g, m_codes, new_m_scales);
    std::printf("first moment step %d %016llx first update %.9g\n", k, (unsigned long long)hash,
                g[0]);
  }
  {
    // The codecs (quantize_state's decode and encode). Block codes under a
    // cubic table, whose entries crowd near 0 (stochastic rounding's general
    // path), nearest and stochastic, then decoded; rank-1 codes, Linear
    // (recipe 0's v table) and not, the latter also stochastic, then decoded.
    RowPassArgs linear(rows, h, true), sqrt_de(rows, h, false);
    float cubic[2 * kTableSize - 1];
    for (int k = 0; k < kTableSize; ++k) {
      const float c = (k - 7.5f) / 7.5f;
      cubic[k] = c * c * c;
    }
    for (int k = 0; k + 1 < kTableSize; ++k) cubic[kTableSize + k] = (cubic[k] + cubic[k + 1]) / 2;
    const std::vector<float> x = gradient();
    std::vector<float> out(rows * d), block_scales(rows * blocks), v_rows(rows, 1e-4f),
        col(d, 1e-4f);  // the decode's column scales, in the row's order
    std::vector<uint8_t> codes(rows * h);
    uint64_t hash = kFnvOffset;
    for (int k = 0; k < 5; ++k) {
      RowPassArgs& args = k == 2 ? linear : sqrt_de;
      CodecRowsArgs a{};
      a.h = h;
      a.rank1 = k >= 2;
      a.stochastic = k == 1 || k == 4;
      a.linear = k == 2;
      a.x = x.data();
      a.table = a.rank1 ? args.v_table() : cubic;
      a.thresholds4 = args.v_thresholds4;
      a.row_scales = v_rows.data();
      a.col_scales = col.data();
      a.inv_col_even = a.inv_col_odd = args.col_inverse.data();
      a.inverse_factor = args.v_linear ? 4.0f : 1.0f;
      a.row_base = args.row_base.data();
      a.seed = 99u;
      a.block_scales_out = block_scales.data();
      a.codes_out = codes.data();
      if (a.rank1) {
        codec.encode_rank1_rows(a, 0, rows, scratch.data());
      } else {
        codec.encode_block_rows(a, 0, rows, scratch.data());
      }
      a.codes = codes.data();
      a.block_scales = block_scales.data();
      a.out = out.data();
      codec.decode_rows(a, 0, rows, scratch.data());
      hash = Fnv(Fnv(Fnv(hash, codes), block_scales), out);
    }
    std::printf("codecs %016llx first decoded %.9g\n", (unsigned long long)hash, out[0]);
  }
  if (argc > 3) {
    std::vector<float> tables8;
    std::vector<int32_t> buckets;
    if (!ReadTables8(argv[3], tables8, buckets)) {
      std::printf("cannot read %s\n", argv[3]);
      return 1;
    }
    const int64_t blocks8 = d / kBlock8;
    RowPassArgs args(rows, h, false);
    std::vector<float> g = gradient(), m_scales(rows * blocks8, old_scale),
                       v_scales(rows * blocks8, 1e-4f);
    std::vector<uint8_t> m_codes = codes(rows * d), v_codes = codes(rows * d);
    path.apply_8bit_rows(args.Apply8bit(g.data(), m_scales.data(), v_scales.data(),
                                        m_codes.data(), v_codes.data(), tables8.data(),
                                        buckets.data()),
                         0, rows, scratch.data());
    const uint64_t hash = Hash(g, m_codes, v_codes, m_scales, v_scales);
    std::printf("adam 8-bit %016llx first update %.9g\n", (unsigned long long)hash, g[0]);
  }
  return 0;
}
"""


def _cross_tools():
  qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
  tools = (shutil.which("g++"), shutil.which("aarch64-linux-gnu-g++"), qemu)
  return tools if all(tools) and sys.platform.startswith("linux") else None


@pytest.mark.skipif(_cross_tools() is None,
                    reason="needs g++, aarch64-linux-gnu-g++ and qemu-aarch64 (Debian: "
                           "g++-aarch64-linux-gnu, qemu-user-static)")
def test_aarch64_and_clang_rows_match_the_native_baseline(tmp_path):
  """Cross-compiled for aarch64 (static) with the flags of setup.py and run
  under qemu-user, the row functions (there NEON code, 4 lanes) write bit for
  bit what the native baseline path writes: 4-bit Adam (both recipes), the
  first-moment steps, the codecs and 8-bit Adam, with subnormal gradients flushed as XLA
  flushes them (on the moments' first step, where they reach the update). So do the
  native build's AVX2 and AVX-512 paths where this CPU runs them. Where Clang is
  installed, its native builds' paths and its aarch64 build (Apple's compiler on macOS
  is Clang) write the same bits too."""
  import jaxlib  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from optax4bit import cpu  # pylint: disable=import-outside-toplevel
  from optax4bit.cpu import ffi  # pylint: disable=import-outside-toplevel
  native_cxx, cross_cxx, qemu = _cross_tools()
  (tmp_path / "rows_check.cc").write_text(_ROWS_CHECK)
  tables8 = tmp_path / "tables8.bin"
  tables8.write_bytes(ffi._tables_8bit("DE", "DE").astype(np.float32).tobytes() +
                      ffi._buckets("DE", "DE").astype(np.int32).tobytes())
  flags = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
           f"-I{Path(jaxlib.__file__).parent / 'include'}", f"-I{ROOT}", "rows_check.cc"]
  # name: (compiler and target, how to run the program, {ISA path: its lanes})
  native_paths = {"baseline": 16, "avx2": 8, "avx512": 16}
  targets = {"native": ([native_cxx], [], native_paths),
             "aarch64": ([cross_cxx, "-static"], [qemu], {"baseline": 4})}
  clang = shutil.which("clang++")
  if clang:
    targets["native-clang"] = ([clang], [], native_paths)
    targets["aarch64-clang"] = ([clang, "--target=aarch64-linux-gnu", "-static"], [qemu],
                                {"baseline": 4})
  builds = {name: subprocess.Popen([*cxx, *flags, "-o", name, "-lpthread"], cwd=tmp_path,
                                   stderr=subprocess.PIPE, text=True)
            for name, (cxx, _, _) in targets.items()}
  for name, build in builds.items():
    stderr = build.communicate(timeout=600)[1]
    assert build.returncode == 0, (name, stderr[-4000:])
  # Every seventh gradient 0 or subnormal; old block scales 0.01, or 0 (the
  # first step, where a subnormal gradient left unflushed reaches the update).
  for tiny, old_scale in (("0", "0.01"), ("1e-36", "0.01"), ("1e-36", "0")):
    args = [tiny, old_scale, str(tables8)]
    outputs = {}
    for name, (_, runner, paths) in targets.items():
      for path, lanes in paths.items():
        result = subprocess.run([*runner, str(tmp_path / name), *args, path],
                                capture_output=True, text=True, timeout=600, check=False)
        if result.returncode == 3 and path != "baseline":  # this CPU does not run the path
          continue
        assert result.returncode == 0, (name, path, result.stderr)
        assert result.stderr.split() == [path, "lanes", str(lanes)], (name, result.stderr)
        outputs[name, path] = result.stdout
    reference = outputs["native", "baseline"]
    assert len(reference.splitlines()) == 8, reference
    for (name, path), stdout in outputs.items():
      assert stdout == reference, (args, name, path, reference, stdout)
    # Every path the installed kernel runs on this CPU ran in each native build.
    for name in ("native", "native-clang") if clang else ("native",):
      assert {path for n, path in outputs if n == name} >= set(cpu.isas()), (name, outputs)
