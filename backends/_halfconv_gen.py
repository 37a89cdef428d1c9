"""Writes backends/_optable.h, the op table of backends/_halfconv.c, from backends/optable.py.

`setup.py` runs `header(optable)` before it compiles the extension (so the C kernels and their
codes are always the table's: Note [one declaration per op] in backends/optable.py), and
tests/test_optable.py checks that the built extension's `ops` are the table's. C takes the ops
whose formula has no transcendental primitive (C's libm need not give NumPy's bits) and whose
operands are one or two floats:

- `OP_<NAME>` codes in table order, `op_arity` and `op_names` (the extension's `ops`);
- `OPTABLE_LOOP(T, SQRT, FABS, SUFFIX, ATTR)`: `optable_<SUFFIX>(code, r, a, b, n)`, the op on
  n contiguous T items, one loop per arithmetic step of the formula over a chunk that stays in
  L1 (so no compiler contracts a product and a sum into one rounding, whatever the target), a
  select and its conditions inlined in the loop of the step that reads them;
- `OPTABLE_ROW_CASES`: the cases of the half kernels' vector path, one AVX intrinsic per step,
  on `va` and `vb` (the operands widened to eight floats) into `r`.

This module, like optable.py, imports nothing but the standard library.
"""

from __future__ import annotations

import re
from types import ModuleType

#: the arithmetic primitives C spells, and which become a loop (a rounding step) of their own
_ARITHMETIC = ("add", "sub", "mul", "div", "sqrt", "abs")
_AVX = {
    "add": "_mm256_add_ps({}, {})", "sub": "_mm256_sub_ps({}, {})",
    "mul": "_mm256_mul_ps({}, {})", "div": "_mm256_div_ps({}, {})",
    "sqrt": "_mm256_sqrt_ps({})", "abs": "_mm256_andnot_ps(_mm256_set1_ps(-0.0f), {})",
    "lt": "_mm256_cmp_ps({}, {}, _CMP_LT_OQ)", "gt": "_mm256_cmp_ps({}, {}, _CMP_GT_OQ)",
    "eq": "_mm256_cmp_ps({}, {}, _CMP_EQ_OQ)", "isnan": "_mm256_cmp_ps({0}, {0}, _CMP_UNORD_Q)",
    # NOTE: x - x is +0 for a finite x, NaN for an infinity or a NaN
    "isfinite": "_mm256_cmp_ps(_mm256_sub_ps({0}, {0}), _mm256_setzero_ps(), _CMP_EQ_OQ)",
    "either": "_mm256_or_ps({}, {})",
    "select": "_mm256_blendv_ps({2}, {1}, {0})",
}


def c_ops(optable: ModuleType) -> list:
    """The table's ops that C runs: one or two float operands, no transcendental primitive."""
    return [op for op in optable.OPS
            if op.arity <= 2 and set(op.operand_kinds) == {optable.FLOAT} and op.exact]


def _steps(optable: ModuleType, formula) -> list:
    """The formula's nodes that get a loop of their own, in evaluation order: each arithmetic
    step, and each select that an arithmetic step reads (a real product, even by 1, as NumPy
    computes it: inlined, the compiler could make g * (c ? 1 : 0) a select of g, and a
    signalling NaN would not come out quiet); the root last."""
    found = []
    for node in optable.nodes(formula):
        arithmetic = node.op in _ARITHMETIC
        for a in node.args if arithmetic else ():
            if isinstance(a, optable.Expr) and a.op == "select" and a not in found:
                found.append(a)
        if arithmetic and node not in found:
            found.append(node)
    return [n for n in found if n != formula] + [formula]


def _scalar(optable: ModuleType, op) -> tuple[list[str], int]:
    """The op's loops over one chunk (a_, b_, r_ of m items) and how many temporaries."""
    order = _steps(optable, op.formula)
    temp = {node: k for k, node in enumerate(order[:-1])}
    style = optable.CStyle("T")
    codes = {**style.code_for_op, "sqrt": lambda a: f"SQRT({a})", "abs": lambda a: f"FABS({a})"}

    def render(expr, top) -> str:
        if not isinstance(expr, optable.Expr):
            return style.render(expr, ())
        if expr.op == "arg":
            return f"x{expr.args[0]}"
        if expr is not top and expr in temp:
            return f"t[{temp[expr]}][i]"
        return codes[expr.op](*(render(a, top) for a in expr.args))

    def loop(node, target: str) -> str:
        # NOTE: each operand read once into a local, before the store (r may be a or b)
        expression = render(node, node)
        loads = "".join(f"T x{k} = {pointer}[i]; " for k, pointer in enumerate(("a_", "b_"))
                        if re.search(rf"\bx{k}\b", expression))
        return f"for (i = 0; i < m; i++) {{ {loads}{target} = {expression}; }}"

    loops = [loop(node, f"t[{temp[node]}][i]") for node in order[:-1]]
    loops.append(loop(op.formula, "r_[i]"))
    return loops, len(temp)


def _vector(optable: ModuleType, expr) -> str:
    if not isinstance(expr, optable.Expr):
        value = optable.float_literal(expr, "float")
        return f"_mm256_set1_ps({value})"
    if expr.op == "arg":
        return ("va", "vb")[expr.args[0]]
    return _AVX[expr.op].format(*(_vector(optable, a) for a in expr.args))


def header(optable: ModuleType) -> str:
    """The text of backends/_optable.h."""
    ops = c_ops(optable)
    names = [op.name.upper() for op in ops]
    functions, cases = [], []
    for op in ops:
        if op.formula.op == "arg":
            continue  # NOTE: copy: apply's loads and stores convert, float_op takes none
        loops, count = _scalar(optable, op)
        if count:  # NOTE: in chunks, so the temporaries stay in L1
            body = [f"T t[{count}][OPTABLE_CHUNK];",
                    "for (Py_ssize_t s = 0; s < n; s += OPTABLE_CHUNK) {",
                    "    Py_ssize_t i, m = n - s < OPTABLE_CHUNK ? n - s : OPTABLE_CHUNK;",
                    "    const T *a_ = a + s, *b_ = b ? b + s : NULL;",
                    "    T *r_ = r + s;",
                    "    (void)b_;",
                    *(f"    {loop}" for loop in loops), "}"]
        else:  # NOTE: one loop over the row, which the compiler vectorises whole
            body = ["const T *a_ = a, *b_ = b;", "T *r_ = r;", "Py_ssize_t i, m = n;",
                    "(void)b_;", *loops]
        name = f"optable_{op.name}_##SUFFIX"
        functions.append(f"ATTR OPTABLE_NOINLINE static void {name}(T *r, const T *a, "
                         f"const T *b, Py_ssize_t n) "
                         "\\\n{ \\\n    " + " \\\n    ".join(body) + " \\\n} \\")
        cases.append(f"        case OP_{op.name.upper()}: {name}(r0, a0, b0, cols); break; \\")
    row = [f"case OP_{op.name.upper()}: r = {_vector(optable, op.formula)}; break;"
           for op in ops if op.formula.op != "arg"]
    lines = [
        "/* Generated from backends/optable.py by backends/_halfconv_gen.py when the extension",
        " * is built (setup.py): do not edit. */",
        f"enum {{ {', '.join(f'OP_{n}' for n in names)}, OP_COUNT }};",
        f"static const int op_arity[OP_COUNT] = {{{', '.join(str(op.arity) for op in ops)}}};",
        "static const char *const op_names[OP_COUNT] = {"
        + ", ".join(f'"{op.name}"' for op in ops) + "};",
        "#define OPTABLE_CHUNK 256",
        "/* each op's loop a function of its own, as the compiler vectorises it best alone */",
        "#if defined(__GNUC__) || defined(__clang__)",
        "#define OPTABLE_NOINLINE __attribute__((noinline))",
        "#else",
        "#define OPTABLE_NOINLINE",
        "#endif",
        "",
        "/* optable_SUFFIX(code, r, a, b, rows, cols, row): r = op(a, b) on rows x cols",
        " * contiguous T items, b of their shape or, where `row`, one row of cols items (b",
        " * unread by a unary op; r may be a or b itself); 0 for a code it has no loop for",
        " * (copy). */",
        "#define OPTABLE_LOOP(T, SQRT, FABS, SUFFIX, ATTR) \\",
        *functions,
        "ATTR static int optable_##SUFFIX(int code, T *r, const T *a, const T *b, \\",
        "                                 Py_ssize_t rows, Py_ssize_t cols, int row) \\",
        "{ \\",
        "    for (Py_ssize_t k = 0; k < rows; k++) { \\",
        "        const T *a0 = a + k * cols, *b0 = b ? b + (row ? 0 : k * cols) : NULL; \\",
        "        T *r0 = r + k * cols; \\",
        "        switch (code) { \\",
        *cases,
        "        default: return 0; \\",
        "        } \\",
        "    } \\",
        "    return 1; \\",
        "}",
        "",
        "/* The vector path's cases: r from va and vb, eight floats each. */",
        "#define OPTABLE_ROW_CASES \\",
        " \\\n".join(row),
        "",
    ]
    return "\n".join(lines)
