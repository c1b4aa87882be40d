"""No import cycle among the modules of jaxspec and pallas_kernels, counting imports inside
functions: each module may use only what lies below it (config, cache and the kernels at the
bottom; the model, prefill and decoding above them; the setup layer, generate and the server on
top)."""

from test_kernel_imports import ROOT, import_cycles, module_graph


def test_no_import_cycles_in_the_library():
    graph = module_graph([ROOT / "jaxspec", ROOT / "pallas_kernels"])
    assert len(graph) > 30  # the graph saw the library
    assert import_cycles(graph) == []


def test_the_cycle_finder_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    assert import_cycles(module_graph([pkg]))
