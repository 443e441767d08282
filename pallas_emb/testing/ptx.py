"""What our Pallas Triton kernels become on an H100/H200, seen from a CPU.

`capture(fn, *args)` lowers `fn` for CUDA (`jax.jit(fn).trace(*args).lower(
lowering_platforms=("cuda",))`, no GPU needed) and records the Triton IR of
every pallas_call in it, with the kernel's parameter names and its
num_warps / num_stages. `compile_kernel(kernel)` compiles that IR for sm_90a
with the `triton` package, runs its bundled `ptxas -v`, and returns a
`PtxReport`: registers, spill bytes, and every global load/store of the
kernel body attributed to the ref it accesses, with the PTX access widths it
became (`b32` = one 4-byte element per thread; `v2.b32` / `v4.b32` = 8 / 16
bytes, i.e. vectorized, coalesced row access).

How accesses are attributed: before compiling, every `tt.load` / `tt.store`
of the IR gets a synthetic location (line K for the K-th access) and every
other op an unknown one, so each `ld.global` / `st.global` of the PTX
follows a `.loc 1 K` line; the access's pointer is traced back through
`tt.addptr` / `tt.splat` / broadcasts to the kernel parameter it offsets,
whose name comes from the kernel's jaxpr.

Uses jax private modules (`jax._src.pallas.triton`): a test helper, not a
library dependency.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import hashlib
import os
import re
import subprocess
import tempfile

import jax
import jax.extend

SM90A = 90


@dataclasses.dataclass(frozen=True)
class CapturedKernel:
  """One pallas_call as lowered for CUDA."""
  name: str
  ttir: str  # Triton IR text with debug locations
  arg_names: tuple[str, ...]  # kernel parameters: inputs, then outputs
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class Access:
  """One global load or store of a kernel, and the PTX it became."""
  ref: str  # the kernel parameter it addresses ('?' if not traced)
  op: str  # 'load' or 'store'
  shape: tuple[int, ...]  # the tensor shape accessed by the program
  dtype: str  # Triton element type, e.g. 'f32', 'bf16', 'i32'
  widths: dict[str, int]  # PTX access kind -> count, e.g. {'v4.b32': 4}

  @property
  def vectorized(self) -> bool:
    """Every PTX instruction of this access moves 8 or 16 bytes."""
    return bool(self.widths) and all(k.startswith("v")
                                     for k in self.widths)


@dataclasses.dataclass(frozen=True)
class PtxReport:
  name: str
  num_warps: int
  num_stages: int
  registers: int | None
  spill_bytes: int
  accesses: tuple[Access, ...]
  ptxas_log: str

  def row(self) -> str:
    """One human-readable line: kernel, registers, spills, accesses."""
    parts = [f"{a.op[0]}:{a.ref}{list(a.shape)}="
             + ",".join(f"{k}x{v}" for k, v in sorted(a.widths.items()))
             for a in self.accesses]
    return (f"{self.name:30s} warps={self.num_warps} regs={self.registers} "
            f"spill={self.spill_bytes} " + " ".join(parts))


def triton_available() -> str | None:
  """None if the `triton` package and its ptxas are usable, else why not."""
  try:
    import triton  # pylint: disable=g-import-not-at-top,unused-import
    from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top,unused-import
  except Exception as e:  # pylint: disable=broad-except
    return f"the triton package is not importable ({e!r})"
  if not _ptxas():
    return "the triton package has no bundled ptxas"
  try:
    _hook_module()
  except (ImportError, AttributeError) as e:
    return (f"jax {jax.__version__} has no Pallas Triton lowering hook "
            f"({e!r})")
  return None


def _ptxas() -> str | None:
  import triton  # pylint: disable=g-import-not-at-top
  found = glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                 "backends", "nvidia", "bin", "ptxas"))
  return found[0] if found else None


def _hook_module():
  from jax._src.pallas.triton import pallas_call_registration as reg  # pylint: disable=g-import-not-at-top
  reg.lowering.lower_jaxpr_to_triton_module  # pylint: disable=pointless-statement
  return reg.lowering


@contextlib.contextmanager
def _recording():
  """Records (name, ttir, arg_names) of every Triton lowering in the block."""
  module = _hook_module()
  original = module.lower_jaxpr_to_triton_module
  records = []

  def hook(*args, **kwargs):
    result = original(*args, **kwargs)
    jaxpr = args[0] if args else kwargs["jaxpr"]
    info = jaxpr.debug_info
    records.append((info.func_name,
                    result.module.operation.get_asm(enable_debug_info=True),
                    tuple(info.arg_names or ())))
    return result

  module.lower_jaxpr_to_triton_module = hook
  try:
    yield records
  finally:
    module.lower_jaxpr_to_triton_module = original


def _subjaxprs(value):
  """Jaxprs nested in an equation parameter (jit, shard_map, cond, ...)."""
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax.extend.core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _subjaxprs(item)


def _launch_params(jaxpr, found=None) -> dict[str, tuple[int, int]]:
  """Kernel name -> (num_warps, num_stages) of every pallas_call, as the
  Triton lowering resolves them (4 warps, 3 stages when unset)."""
  found = {} if found is None else found
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      params = eqn.params.get("compiler_params")
      num_warps = getattr(params, "num_warps", None)
      num_stages = getattr(params, "num_stages", None)
      name = eqn.params["jaxpr"].debug_info.func_name
      found[name] = (4 if num_warps is None else num_warps,
                     3 if num_stages is None else num_stages)
      continue
    for value in eqn.params.values():
      for sub in _subjaxprs(value):
        _launch_params(sub, found)
  return found


def capture(fn, *args, **kwargs) -> list[CapturedKernel]:
  """The Triton kernels of `jax.jit(fn, **kwargs)(*args)` lowered for CUDA."""
  traced = jax.jit(fn, **kwargs).trace(*args)
  params = _launch_params(traced.jaxpr.jaxpr)
  with _recording() as records:
    traced.lower(lowering_platforms=("cuda",))
  kernels = []
  for name, ttir, arg_names in records:
    if name not in params:
      raise RuntimeError(f"pallas_emb.testing.ptx: no pallas_call named "
                         f"{name!r} in the traced program ({sorted(params)})")
    num_warps, num_stages = params[name]
    kernels.append(CapturedKernel(name, ttir, arg_names, num_warps,
                                  num_stages))
  return kernels


# --------------------------------------------------------------------------
# IR rewriting and access attribution
# --------------------------------------------------------------------------

_OP_LINE = re.compile(r"^\s*(?:(%[\w#]+)(?::\d+)?\s*=\s*)?([\w.]+)\s+(.*)$")
_ACCESS = re.compile(r"^(\s*(?:%[\w#]+\s*=\s*)?)(tt\.load|tt\.store)\s")
_LOC_REF = re.compile(r"loc\(#loc\d*\)")
_TENSOR = re.compile(r"tensor<([\dx]+)x!tt\.ptr<(\w+)>>")
_SCALAR_PTR = re.compile(r"!tt\.ptr<(\w+)>")
_FOLLOW = ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims",
           "tt.reshape", "tt.trans")


def _tag_accesses(ttir: str):
  """IR with locations only on loads/stores; their (line, op, ptr, type)."""
  text = _LOC_REF.sub("loc(#loc)", ttir)
  lines, accesses = [], []
  for line in text.splitlines():
    match = _ACCESS.match(line)
    if match and line.rstrip().endswith("loc(#loc)"):
      k = len(accesses) + 1
      operands = line[match.end():]
      ptr = re.match(r"\s*(%[\w#]+)", operands).group(1)
      typ = line[line.rindex(" : ") + 3:] if " : " in line else ""
      accesses.append((k, match.group(2)[3:], ptr, typ, len(lines)))
      line = line.rstrip()[:-len("loc(#loc)")] + f'loc("access":{k}:1)'
    lines.append(line)
  return "\n".join(lines) + "\n", accesses


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _num_params(lines: list[str]) -> int:
  for line in lines:
    if "tt.func" in line:  # the header, one line: `(%arg0: !tt.ptr<...> ...`
      return len(re.findall(r"%arg\d+\s*:", line))
  return 0


def _bindings(line: str) -> list[tuple[str, str]]:
  """`%argN = %init` pairs of an scf.for iter_args / scf.while header."""
  return re.findall(r"(%arg\d+)\s*=\s*(%[\w#]+)", line)


def _block_arg_init(lines, index, indent, name):
  """The initial value bound to a region argument `name`, if traceable.

  scf.for `iter_args(%a = %x)` and scf.while `(%a = %x)` bind it directly;
  the `^bb0(...)` arguments of a while's after-region receive the
  before-region's arguments in order (the Pallas lowering forwards them
  all), so position p maps to the header's p-th binding.
  """
  for j in range(index - 1, -1, -1):
    line = lines[j]
    if _indent(line) > indent:
      continue
    if "^bb0(" in line and re.search(rf"{re.escape(name)}\s*:", line):
      position = re.findall(r"(%arg\d+)\s*:", line).index(name)
      for k in range(j - 1, -1, -1):
        if "scf.while" in lines[k] and _indent(lines[k]) <= _indent(line):
          pairs = _bindings(lines[k])
          return (k, pairs[position][1]) if position < len(pairs) else None
      return None
    for arg, init in _bindings(line):
      if arg == name and ("scf.for" in line or "scf.while" in line):
        return j, init
  return None


def _trace_arg(lines: list[str], index: int, ptr: str,
               num_params: int) -> int | None:
  """The kernel parameter a pointer used at `lines[index]` derives from.

  SSA names are reused across sibling regions (each region numbers its
  values anew, and region arguments are `%argN` too), so a name resolves to
  the nearest binding above the use that is not nested deeper than it.
  """
  indent = _indent(lines[index])
  for _ in range(64):
    arg = re.fullmatch(r"%arg(\d+)", ptr)
    if arg:
      found = _block_arg_init(lines, index, indent, ptr)
      if found is None:
        return int(arg.group(1)) if int(arg.group(1)) < num_params else None
      index, ptr = found
      indent = _indent(lines[index])
      continue
    pattern = re.compile(rf"^\s*{re.escape(ptr)}(?::\d+)?\s*=\s*")
    for j in range(index - 1, -1, -1):
      if _indent(lines[j]) <= indent and pattern.match(lines[j]):
        break
    else:
      return None
    match = _OP_LINE.match(lines[j])
    if not match or match.group(2) not in _FOLLOW:
      return None
    operand = re.match(r"\s*(%[\w#]+)", match.group(3))
    if not operand:
      return None
    index, indent, ptr = j, _indent(lines[j]), operand.group(1)
  return None


def _shape_and_dtype(typ: str):
  tensor = _TENSOR.search(typ)
  if tensor:
    return tuple(int(d) for d in tensor.group(1).split("x")), tensor.group(2)
  scalar = _SCALAR_PTR.search(typ)
  return (), scalar.group(1) if scalar else "?"


def _ptx_widths(ptx: str) -> dict[int, collections.Counter]:
  """Global access kinds per `.loc` line of the PTX."""
  per_line = collections.defaultdict(collections.Counter)
  line_no = 0
  for line in ptx.splitlines():
    loc = re.match(r"\s*\.loc\s+\d+\s+(\d+)\s", line)
    if loc:
      line_no = int(loc.group(1))
      continue
    access = re.search(r"\b(ld|st)\.global((?:\.[a-z0-9]+)*)", line)
    if access:
      mods = access.group(2).split(".")
      vec = next((m for m in mods if m in ("v2", "v4", "v8")), "")
      ty = next((m for m in reversed(mods) if re.fullmatch(r"[bfsu]\d+", m)),
                "?")
      per_line[line_no][(access.group(1), (vec + "." if vec else "") + ty)] += 1
  return per_line


@functools.lru_cache(maxsize=256)
def _compile_cached(ttir: str, num_warps: int, num_stages: int, arch: int):
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix="pallas_emb_ptx_") as workdir:
    digest = hashlib.sha1(ttir.encode()).hexdigest()[:12]
    path = os.path.join(workdir, f"k{digest}.ttir")
    with open(path, "w") as f:
      f.write(ttir)
    compiled = triton.compile(
        path, target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    ptx_path = path[:-5] + ".ptx"
    with open(ptx_path, "w") as f:
      f.write(ptx)
    result = subprocess.run(
        [_ptxas(), "-v", f"-arch=sm_{arch}a", ptx_path, "-o", os.devnull],
        capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"ptxas failed: {result.stderr[-2000:]}")
  return ptx, result.stderr


def compile_kernel(kernel: CapturedKernel, arch: int = SM90A) -> PtxReport:
  """Compiles one captured kernel for sm_{arch}a and attributes its accesses."""
  tagged, accesses = _tag_accesses(kernel.ttir)
  lines = tagged.splitlines()
  ptx, log = _compile_cached(tagged, kernel.num_warps, kernel.num_stages,
                             arch)
  widths = _ptx_widths(ptx)
  out = []
  num_params = _num_params(lines)
  for k, op, ptr, typ, index in accesses:
    arg = _trace_arg(lines, index, ptr, num_params)
    ref = (kernel.arg_names[arg] if arg is not None
           and arg < len(kernel.arg_names) else "?")
    shape, dtype = _shape_and_dtype(typ)
    kind = "ld" if op == "load" else "st"
    counts = {w: n for (d, w), n in widths.get(k, {}).items() if d == kind}
    out.append(Access(ref, op, shape, dtype, counts))
  regs = re.search(r"Used (\d+) registers", log)
  spill = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)",
                                         log))
  return PtxReport(kernel.name, kernel.num_warps, kernel.num_stages,
                   int(regs.group(1)) if regs else None, spill,
                   tuple(a for a in out if a.widths), log)
