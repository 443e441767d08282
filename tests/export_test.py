"""pallas_emb.export: a served function reloaded in a fresh process.

Three exports: a collection lookup (backend="xla", 8 devices, an f32 and a
bf16 table) plus a dense layer, one program per batch size; an int8
serving table (`quantize_rows`, uint8 codes, f32 scale and bias) on one
device; a dense function with a symbolic batch dimension. A subprocess with
8 CPU devices that imports only jax, numpy and pallas_emb loads them, runs
them, and its outputs must equal the exporting process's bit for bit; flax,
optax, orbax and haiku must not be imported there.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from unittest import mock

import test_util

from absl.testing import absltest
import jax
from jax import export as jax_export
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import pallas_emb as pe
from pallas_emb import errors
from pallas_emb import export
from pallas_emb import kernels
from pallas_emb import quantize

BATCH_SIZES = (16, 64)
TRAINING_ONLY = ("flax", "optax", "orbax", "haiku")

# Runs in the fresh process: argv[1] the directory of the exports.
LOADER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import jax
    import pallas_emb
    from pallas_emb import export
    root = sys.argv[1]
    with open(os.path.join(root, "inputs.json")) as f:
      calls = json.load(f)
    inputs = np.load(os.path.join(root, "inputs.npz"))
    outs = {}
    for name, keys in calls.items():
      served = export.load(os.path.join(root, name))
      for i, key_list in enumerate(keys):
        args = {k.split("/", 2)[2]: inputs[k] for k in key_list}
        if list(args) == [""]:
          args = args[""]
        out = jax.tree_util.tree_leaves(served(args))
        for j, leaf in enumerate(out):
          outs[f"{name}/{i}/{j}"] = np.asarray(leaf)
    np.savez(os.path.join(root, "outputs.npz"), **outs)
    loaded = sorted(m for m in sys.modules
                    if m.split(".")[0] in {TRAINING_ONLY})
    print(json.dumps({{"devices": jax.device_count(), "loaded": loaded}}))
""").replace("{TRAINING_ONLY}", repr(set(TRAINING_ONLY))).replace(
    "{{", "{").replace("}}", "}")


def collection_case():
  mesh = test_util.mesh({"x": 8})
  opt = pe.Sgd(0.1)
  tables = [pe.TableSpec("items", 100, 16, optimizer=opt),
            pe.TableSpec("genre", 10, 8, optimizer=opt, dtype=jnp.bfloat16)]
  features = [pe.FeatureSpec("item", table="items"),
              pe.FeatureSpec("genres", table="genre", combiner="mean")]
  coll = pe.EmbeddingCollection(tables, features, mesh, "x", backend="xla")
  key = jax.random.key(0)
  state = {"emb": coll.init(key),
           "w": jax.random.normal(jax.random.fold_in(key, 1), (16, 8))}

  def fn(state, batch):
    emb = coll.lookup(state["emb"], batch)
    hidden = jnp.tanh(emb["item"] @ state["w"])
    return {"logits": hidden + emb["genres"].astype(jnp.float32),
            "item": emb["item"]}

  rng = np.random.default_rng(0)
  batches = [{"item": rng.integers(-120, 120, n).astype(np.int32),
              "genres": rng.integers(0, 10, (n, 3)).astype(np.int32)}
             for n in BATCH_SIZES]
  return fn, state, batches


def quantized_case():
  table = np.random.default_rng(1).standard_normal((50, 12)).astype(
      np.float32)
  state = {"rows": quantize.quantize_rows(table, "int8"),
           "bias": jnp.arange(12, dtype=jnp.bfloat16)}

  def fn(state, ids):
    emb = kernels.gather_dequantized(*state["rows"], ids, backend="xla")
    return emb + state["bias"].astype(jnp.float32)

  ids = np.arange(-55, 55, 3, dtype=np.int32)
  return fn, state, [ids]


class ExportTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.dir = tempfile.mkdtemp(prefix="pallas_emb_export_")
    cls.expected, calls, inputs = {}, {}, {}
    cases = {"collection": collection_case(), "quantized": quantized_case()}
    for name, (fn, state, args) in cases.items():
      export.save(os.path.join(cls.dir, name), fn, state,
                  [(a,) for a in args])
      calls[name] = []
      for i, a in enumerate(args):
        flat = a if isinstance(a, dict) else {"": a}
        calls[name].append([f"{name}/{i}/{k}" for k in flat])
        inputs.update({f"{name}/{i}/{k}": v for k, v in flat.items()})
        out = jax.tree_util.tree_leaves(jax.jit(fn)(state, a))
        cls.expected.update({f"{name}/{i}/{j}": test_util.as_numpy(leaf)
                             for j, leaf in enumerate(out)})
    # One program for every batch size of a function that allows it.
    w = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    (b,) = jax_export.symbolic_shape("b")
    dense = jax.jit(lambda s, x: jnp.sin(x @ s["w"]))
    export.save(os.path.join(cls.dir, "symbolic"), dense, {"w": w},
                [(jax.ShapeDtypeStruct((b, 8), jnp.float32),)])
    calls["symbolic"] = []
    for i, n in enumerate((3, 5)):
      x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
      calls["symbolic"].append([f"symbolic/{i}/"])
      inputs[f"symbolic/{i}/"] = x
      cls.expected[f"symbolic/{i}/0"] = np.asarray(dense({"w": w}, x))
    np.savez(os.path.join(cls.dir, "inputs.npz"), **inputs)
    with open(os.path.join(cls.dir, "inputs.json"), "w") as f:
      json.dump(calls, f)

  def test_fresh_process_matches_bit_for_bit(self):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (test_util.ROOT, env.get("PYTHONPATH")) if p)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", LOADER, self.dir], env=env,
                          capture_output=True, text=True, timeout=300,
                          check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-5000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertEqual(report, {"devices": 8, "loaded": []})
    with np.load(os.path.join(self.dir, "outputs.npz")) as got:
      self.assertEqual(sorted(got), sorted(self.expected))
      for key, want in self.expected.items():
        got_key = got[key]
        if want.dtype.name == "bfloat16":
          got_key = got_key.view(want.dtype)
        test_util.assert_bits_equal(self, got_key, want, key)

  def test_state_is_placed_as_exported(self):
    served = export.load(os.path.join(self.dir, "collection"))
    _, state, _ = collection_case()
    leaves = jax.tree_util.tree_leaves(state)
    self.assertLen(served.state, len(leaves))
    mesh = served.state[0].sharding.mesh
    for got, want in zip(served.state, leaves):
      # Sharded leaves as they were; a single-device leaf is replicated.
      spec = (want.sharding.spec if isinstance(want.sharding, NamedSharding)
              else P())
      self.assertTrue(got.sharding.is_equivalent_to(
          NamedSharding(mesh, spec), want.ndim), f"{got.sharding} {spec}")
      test_util.assert_bits_equal(self, got, test_util.as_numpy(want))
    self.assertIn("['emb'].stacks", served.state_paths[0])

  def test_unexported_shape_is_an_input_error(self):
    served = export.load(os.path.join(self.dir, "collection"))
    batch = {"item": np.zeros(8, np.int32),
             "genres": np.zeros((8, 3), np.int32)}
    with self.assertRaisesRegex(
        errors.InputError, r"got arguments \(int32\[8, 3\], int32\[8\]\); it "
        r"was exported for \['int32\[16, 3\], int32\[16\]', "
        r"'int32\[64, 3\], int32\[64\]'\]"):
      served(batch)
    with self.assertRaisesRegex(errors.InputError, r"got arguments "
                                r"\(float32\[16, 3\], int32\[16\]\)"):
      served({"item": np.zeros(16, np.int32),
              "genres": np.zeros((16, 3), np.float32)})

  def test_pallas_kernels_export_for_cuda(self):
    """The Triton calls of backend="triton" are allowed (lowered here on CPU).
    """
    table = np.random.default_rng(2).standard_normal((50, 16)).astype(
        np.float32)
    ids = np.arange(-20, 44, dtype=np.int32)
    path = os.path.join(self.dir, "pallas")
    export.save(path, lambda t, i: kernels.gather_rows(t, i, backend="triton"),
                table, [(ids,)], platforms=("cuda",))
    self.assertTrue(os.path.exists(os.path.join(path, "manifest.json")))
    # jax.export alone refuses them.
    with mock.patch.object(export, "_PALLAS_CALLS", ()):
      with self.assertRaisesRegex(ValueError, "custom call"):
        export.save(path + "_unchecked", lambda t, i: kernels.gather_rows(
            t, i, backend="triton"), table, [(ids,)], platforms=("cuda",))

  def test_save_and_load_checks(self):
    with self.assertRaisesRegex(errors.InputError, "example_args is empty"):
      export.save(self.dir, lambda s, x: x, {}, [])
    with self.assertRaisesRegex(errors.InputError,
                                r"state\['n'\] is a str; expected every leaf"):
      export.save(self.dir, lambda s, x: x, {"n": "name"}, [(1.0,)])
    with self.assertRaisesRegex(errors.CheckpointError,
                                "found no readable manifest.json"):
      export.load(os.path.join(self.dir, "missing"))


if __name__ == "__main__":
  absltest.main()
