//! A score function as a small expression program ([`ScoreExpr`]): nodes over the score, the
//! index `(batch, head, q, k)`, constants, arithmetic, elementary functions, comparisons,
//! selection and lookups into captured tables, evaluated in f64 with the derivative with
//! respect to the score by forward-mode differentiation. The Python package traces a
//! FlexAttention `score_mod` callable into one.
//!
//! Every value is an f64; the index values are integers, comparisons give 1 or 0, and a
//! condition is true when it is non-zero. A lookup whose index is not an integer in
//! `-len..len` (negative ones count from the end, as Python's) reads NaN.

use std::cell::RefCell;

use crate::block_mask::MaskIndex;
use crate::error::{ErrorKind, Result};
use crate::score_fn::{ScoreFunction, ScoreStrip, ScoreValue};

/// One-argument operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unary {
    Neg,
    Abs,
    Exp,
    Log,
    Tanh,
    Sigmoid,
    Sqrt,
    Floor,
    /// Logical not: 1 where the argument is 0, else 0.
    Not,
}

/// Two-argument operations. `FloorDiv` and `Rem` follow Python's (and torch's) floor rounding:
/// `a - b · floor(a / b)` takes the divisor's sign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    FloorDiv,
    Rem,
    Pow,
    Min,
    Max,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    And,
    Or,
}

/// A node of the program; arguments name earlier nodes by index.
#[derive(Clone, Debug, PartialEq)]
pub enum Node {
    /// The score the function is applied to.
    Score,
    Batch,
    Head,
    /// The query row.
    Q,
    /// The key.
    K,
    Const(f64),
    Unary(Unary, usize),
    Binary(Binary, usize, usize),
    /// `where(cond, a, b)`.
    Where(usize, usize, usize),
    /// `tables[table][index...]`, one node per dimension of the table.
    Lookup {
        table: usize,
        index: Vec<usize>,
    },
}

/// A captured tensor: `data` row-major with `shape`.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    pub data: Vec<f64>,
    pub shape: Vec<usize>,
}

/// A validated expression program; the value of node `output` is the function's.
#[derive(Clone, Debug)]
pub struct ScoreExpr {
    nodes: Vec<Node>,
    tables: Vec<Table>,
    output: usize,
    /// Whether each node depends on the score (the others have derivative 0).
    on_score: Vec<bool>,
    /// Whether each node is the same for every score of a strip (it reads neither the score
    /// nor the query row): computed once per strip and broadcast.
    uniform: Vec<bool>,
}

fn invalid(detail: String) -> crate::Error {
    ErrorKind::ScoreExpr { detail }.into()
}

impl ScoreExpr {
    /// Checks that every argument names an earlier node, every lookup a table with as many
    /// dimensions as it has indices, every table's data its shape's size, and `output` a node.
    pub fn new(nodes: Vec<Node>, tables: Vec<Table>, output: usize) -> Result<Self> {
        if output >= nodes.len() {
            return Err(invalid(format!(
                "output node {output} of {} nodes",
                nodes.len()
            )));
        }
        for (t, table) in tables.iter().enumerate() {
            let len = table
                .shape
                .iter()
                .try_fold(1usize, |a, &x| a.checked_mul(x));
            if len != Some(table.data.len()) {
                return Err(invalid(format!(
                    "table {t} has {} values for shape {:?}",
                    table.data.len(),
                    table.shape
                )));
            }
        }
        let mut on_score = Vec::with_capacity(nodes.len());
        let mut uniform = Vec::with_capacity(nodes.len());
        for (i, node) in nodes.iter().enumerate() {
            let args: Vec<usize> = match node {
                Node::Unary(_, a) => vec![*a],
                Node::Binary(_, a, b) => vec![*a, *b],
                Node::Where(c, a, b) => vec![*c, *a, *b],
                Node::Lookup { table, index } => {
                    let Some(t) = tables.get(*table) else {
                        return Err(invalid(format!(
                            "node {i} reads table {table} of {}",
                            tables.len()
                        )));
                    };
                    if t.shape.len() > MAX_DIMS {
                        return Err(invalid(format!(
                            "node {i} reads table {table} of {} dimensions (at most {MAX_DIMS})",
                            t.shape.len()
                        )));
                    }
                    if t.shape.len() != index.len() {
                        return Err(invalid(format!(
                            "node {i} indexes table {table} of shape {:?} with {} indices",
                            t.shape,
                            index.len()
                        )));
                    }
                    index.clone()
                }
                _ => vec![],
            };
            if let Some(a) = args.iter().find(|&&a| a >= i) {
                return Err(invalid(format!(
                    "node {i} reads node {a}, not an earlier one"
                )));
            }
            let dep = match node {
                Node::Score => true,
                // Comparisons, floors and lookups are piecewise constant in the score.
                Node::Unary(Unary::Not | Unary::Floor, _) | Node::Lookup { .. } => false,
                Node::Binary(op, a, b) => {
                    !matches!(
                        op,
                        Binary::FloorDiv
                            | Binary::Lt
                            | Binary::Le
                            | Binary::Gt
                            | Binary::Ge
                            | Binary::Eq
                            | Binary::Ne
                            | Binary::And
                            | Binary::Or
                    ) && (on_score[*a] || on_score[*b])
                }
                Node::Where(_, a, b) => on_score[*a] || on_score[*b],
                Node::Unary(_, a) => on_score[*a],
                _ => false,
            };
            on_score.push(dep);
            uniform.push(match node {
                Node::Score | Node::Q => false,
                _ => args.iter().all(|&a| uniform[a]),
            });
        }
        Ok(ScoreExpr {
            nodes,
            tables,
            output,
            on_score,
            uniform,
        })
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Evaluates the program over the strip `at` with scores `scores`: `vals` and (with
    /// `tans`) the tangents hold `nodes.len() · n` values, node-major.
    fn run(&self, at: ScoreStrip, scores: &[f64], vals: &mut [f64], mut tans: Option<&mut [f64]>) {
        let n = scores.len();
        for (i, node) in self.nodes.iter().enumerate() {
            let (done, rest) = vals.split_at_mut(i * n);
            // A uniform node: its first element, then broadcast (its arguments are uniform too).
            let m = if self.uniform[i] { n.min(1) } else { n };
            let out = &mut rest[..m];
            let arg = |a: usize| &done[a * n..a * n + m];
            match node {
                Node::Score => out.copy_from_slice(scores),
                Node::Batch => out.fill(at.batch as f64),
                Node::Head => out.fill(at.head as f64),
                Node::Q => (0..n).for_each(|r| out[r] = (at.q0 + r) as f64),
                Node::K => out.fill(at.k as f64),
                Node::Const(c) => out.fill(*c),
                Node::Unary(op, a) => unary(*op, arg(*a), out),
                Node::Binary(op, a, b) => binary(*op, (arg(*a), arg(*b)), out),
                Node::Where(c, a, b) => {
                    for (r, o) in out.iter_mut().enumerate() {
                        *o = if arg(*c)[r] != 0.0 {
                            arg(*a)[r]
                        } else {
                            arg(*b)[r]
                        };
                    }
                }
                Node::Lookup { table, index } => {
                    let t = &self.tables[*table];
                    let mut cols: [&[f64]; MAX_DIMS] = [&[]; MAX_DIMS];
                    for (c, &a) in cols.iter_mut().zip(index) {
                        *c = arg(a);
                    }
                    let cols = &cols[..index.len()];
                    for (r, o) in out.iter_mut().enumerate() {
                        *o = lookup(t, cols, r);
                    }
                }
            }
            if m < n {
                let first = rest[0];
                rest[1..n].fill(first);
            }
            let out = &rest[..n];
            let Some(tans) = tans.as_deref_mut() else {
                continue;
            };
            let (tdone, trest) = tans.split_at_mut(i * n);
            let dout = &mut trest[..n];
            if !self.on_score[i] {
                dout.fill(0.0);
                continue;
            }
            let tan = |a: usize| &tdone[a * n..(a + 1) * n];
            match node {
                Node::Score => dout.fill(1.0),
                Node::Unary(op, a) => {
                    for (r, d) in dout.iter_mut().enumerate() {
                        *d = d_unary(*op, arg(*a)[r], out[r]) * tan(*a)[r];
                    }
                }
                Node::Binary(op, a, b) => {
                    let on = (self.on_score[*a], self.on_score[*b]);
                    for (r, d) in dout.iter_mut().enumerate() {
                        let (x, y) = (arg(*a)[r], arg(*b)[r]);
                        let (dx, dy) = (tan(*a)[r], tan(*b)[r]);
                        *d = d_binary(*op, (x, y, out[r]), (dx, dy), on);
                    }
                }
                Node::Where(c, a, b) => {
                    for (r, d) in dout.iter_mut().enumerate() {
                        *d = if arg(*c)[r] != 0.0 {
                            tan(*a)[r]
                        } else {
                            tan(*b)[r]
                        };
                    }
                }
                _ => dout.fill(0.0),
            }
        }
    }

    /// Replaces `scores` (one strip) by the function's values and writes its derivative into
    /// `grad`, through the scratch of this thread.
    fn eval<X: Lane>(&self, at: ScoreStrip, scores: &mut [X], grad: Option<&mut [X]>) {
        thread_local! {
            static SCRATCH: RefCell<Scratch> = const {
                RefCell::new(Scratch { input: Vec::new(), vals: Vec::new(), tans: Vec::new() })
            };
        }
        SCRATCH.with(|s| {
            let Scratch { input, vals, tans } = &mut *s.borrow_mut();
            let n = scores.len();
            let len = self.nodes.len() * n;
            input.clear();
            input.extend(scores.iter().map(|x| x.wide()));
            vals.resize(len, 0.0);
            let tans_out = match grad.is_some() {
                true => {
                    tans.resize(len, 0.0);
                    Some(&mut tans[..len])
                }
                false => None,
            };
            self.run(at, input, &mut vals[..len], tans_out);
            let o = self.output * n;
            for (x, &y) in scores.iter_mut().zip(&vals[o..o + n]) {
                *x = X::narrow(y);
            }
            if let Some(g) = grad {
                for (d, &t) in g.iter_mut().zip(&tans[o..o + n]) {
                    *d = X::narrow(t);
                }
            }
        });
    }
}

/// The float types a program reads and writes (it computes in f64).
trait Lane: Copy {
    fn wide(self) -> f64;
    fn narrow(x: f64) -> Self;
}

impl Lane for f32 {
    fn wide(self) -> f64 {
        self as f64
    }
    fn narrow(x: f64) -> Self {
        x as f32
    }
}

impl Lane for f64 {
    fn wide(self) -> f64 {
        self
    }
    fn narrow(x: f64) -> Self {
        x
    }
}

/// Per-thread buffers of [`ScoreExpr::eval`]: the scores, and node values and tangents,
/// node-major. Reused, never zeroed: every call writes what it reads.
struct Scratch {
    input: Vec<f64>,
    vals: Vec<f64>,
    tans: Vec<f64>,
}

/// Dimensions a looked-up table may have.
const MAX_DIMS: usize = 8;

/// `t[cols[0][r], cols[1][r], ...]`, NaN for an index that is not an integer in `-len..len`.
#[inline]
fn lookup(t: &Table, cols: &[&[f64]], r: usize) -> f64 {
    let mut flat = 0usize;
    for (col, &len) in cols.iter().zip(&t.shape) {
        let (x, len_f) = (col[r], len as f64);
        if !(x.fract() == 0.0 && x >= -len_f && x < len_f) {
            return f64::NAN;
        }
        let i = if x < 0.0 { x + len_f } else { x } as usize;
        flat = flat * len + i;
    }
    t.data[flat]
}

fn bool_f(b: bool) -> f64 {
    if b {
        1.0
    } else {
        0.0
    }
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `out = f(x)` element by element; one loop per operation, so that the simple ones vectorise.
#[inline(always)]
fn map1(out: &mut [f64], x: &[f64], f: impl Fn(f64) -> f64) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o = f(x);
    }
}

/// `out = f(x, y)` element by element (as [`map1`]).
#[inline(always)]
fn map2(out: &mut [f64], (x, y): (&[f64], &[f64]), f: impl Fn(f64, f64) -> f64) {
    for ((o, &x), &y) in out.iter_mut().zip(x).zip(y) {
        *o = f(x, y);
    }
}

fn unary(op: Unary, x: &[f64], out: &mut [f64]) {
    match op {
        Unary::Neg => map1(out, x, |x| -x),
        Unary::Abs => map1(out, x, f64::abs),
        Unary::Exp => map1(out, x, f64::exp),
        Unary::Log => map1(out, x, f64::ln),
        Unary::Tanh => map1(out, x, f64::tanh),
        Unary::Sigmoid => map1(out, x, sigmoid),
        Unary::Sqrt => map1(out, x, f64::sqrt),
        Unary::Floor => map1(out, x, f64::floor),
        Unary::Not => map1(out, x, |x| bool_f(x == 0.0)),
    }
}

/// d(op(x))/dx, given `y = op(x)`.
fn d_unary(op: Unary, x: f64, y: f64) -> f64 {
    match op {
        Unary::Neg => -1.0,
        Unary::Abs => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        Unary::Exp => y,
        Unary::Log => 1.0 / x,
        Unary::Tanh => 1.0 - y * y,
        Unary::Sigmoid => y * (1.0 - y),
        Unary::Sqrt => 0.5 / y,
        Unary::Floor | Unary::Not => 0.0,
    }
}

fn binary(op: Binary, xy: (&[f64], &[f64]), out: &mut [f64]) {
    match op {
        Binary::Add => map2(out, xy, |x, y| x + y),
        Binary::Sub => map2(out, xy, |x, y| x - y),
        Binary::Mul => map2(out, xy, |x, y| x * y),
        Binary::Div => map2(out, xy, |x, y| x / y),
        Binary::FloorDiv => map2(out, xy, |x, y| (x / y).floor()),
        Binary::Rem => map2(out, xy, |x, y| x - y * (x / y).floor()),
        Binary::Pow => map2(out, xy, f64::powf),
        // NaN propagates, as torch.minimum and torch.maximum.
        Binary::Min => map2(out, xy, |x, y| {
            if x.is_nan() || y.is_nan() {
                f64::NAN
            } else {
                x.min(y)
            }
        }),
        Binary::Max => map2(out, xy, |x, y| {
            if x.is_nan() || y.is_nan() {
                f64::NAN
            } else {
                x.max(y)
            }
        }),
        Binary::Lt => map2(out, xy, |x, y| bool_f(x < y)),
        Binary::Le => map2(out, xy, |x, y| bool_f(x <= y)),
        Binary::Gt => map2(out, xy, |x, y| bool_f(x > y)),
        Binary::Ge => map2(out, xy, |x, y| bool_f(x >= y)),
        Binary::Eq => map2(out, xy, |x, y| bool_f(x == y)),
        Binary::Ne => map2(out, xy, |x, y| bool_f(x != y)),
        Binary::And => map2(out, xy, |x, y| bool_f(x != 0.0 && y != 0.0)),
        Binary::Or => map2(out, xy, |x, y| bool_f(x != 0.0 || y != 0.0)),
    }
}

/// The tangent of `z = op(x, y)` from the arguments' tangents; `on` says which arguments depend
/// on the score (a term of one that does not is 0, and skipped, so that `ln` of a negative base
/// does not turn a constant exponent's zero term into NaN).
fn d_binary(op: Binary, (x, y, z): (f64, f64, f64), (dx, dy): (f64, f64), on: (bool, bool)) -> f64 {
    let term = |on: bool, f: &dyn Fn() -> f64| if on { f() } else { 0.0 };
    match op {
        Binary::Add => dx + dy,
        Binary::Sub => dx - dy,
        Binary::Mul => term(on.0, &|| dx * y) + term(on.1, &|| x * dy),
        Binary::Div => term(on.0, &|| dx / y) - term(on.1, &|| x * dy / (y * y)),
        Binary::Rem => term(on.0, &|| dx) - term(on.1, &|| (x / y).floor() * dy),
        Binary::Pow => term(on.0, &|| y * x.powf(y - 1.0) * dx) + term(on.1, &|| z * x.ln() * dy),
        // The chosen argument's tangent (the first on ties, as torch's).
        Binary::Min => {
            if x <= y {
                dx
            } else {
                dy
            }
        }
        Binary::Max => {
            if x >= y {
                dx
            } else {
                dy
            }
        }
        _ => 0.0,
    }
}

impl ScoreFunction for ScoreExpr {
    fn apply(&self, at: ScoreStrip, scores: &mut [f32], grad: Option<&mut [f32]>) {
        self.eval(at, scores, grad);
    }

    fn eval_f64(&self, at: MaskIndex, score: f64) -> ScoreValue {
        let (mut y, mut g) = ([score], [0.0]);
        self.eval(ScoreStrip::from(at), &mut y, Some(&mut g));
        ScoreValue {
            value: y[0],
            grad: g[0],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(q: usize, k: usize) -> MaskIndex {
        MaskIndex {
            batch: 1,
            head: 2,
            q,
            k,
        }
    }

    /// `op(score, 0.75 + q)` and `op(score)` programs: each value against the formula, each
    /// derivative against a central difference in f64.
    #[test]
    fn derivatives_match_differences() {
        let unaries = [
            Unary::Neg,
            Unary::Abs,
            Unary::Exp,
            Unary::Log,
            Unary::Tanh,
            Unary::Sigmoid,
            Unary::Sqrt,
        ];
        let binaries = [
            Binary::Add,
            Binary::Sub,
            Binary::Mul,
            Binary::Div,
            Binary::Rem,
            Binary::Pow,
            Binary::Min,
            Binary::Max,
        ];
        let mut programs: Vec<Vec<Node>> = unaries
            .iter()
            .map(|&u| vec![Node::Score, Node::Unary(u, 0)])
            .collect();
        for &b in &binaries {
            let c = vec![
                Node::Score,
                Node::Q,
                Node::Const(0.75),
                Node::Binary(Binary::Add, 1, 2),
            ];
            let mut x = c.clone();
            x.push(Node::Binary(b, 0, 3));
            programs.push(x);
            let mut y = c;
            y.push(Node::Binary(b, 3, 0));
            programs.push(y);
        }
        for nodes in programs {
            let out = nodes.len() - 1;
            let e = ScoreExpr::new(nodes.clone(), vec![], out).unwrap();
            for s in [0.3f64, 1.7, 2.9] {
                let v = e.eval_f64(at(1, 0), s);
                let h = 1e-6;
                let fd = (e.eval_f64(at(1, 0), s + h).value - e.eval_f64(at(1, 0), s - h).value)
                    / (2.0 * h);
                assert!(
                    (v.grad - fd).abs() <= 1e-6 * (1.0 + fd.abs()),
                    "{nodes:?} at {s}: {} vs {fd}",
                    v.grad
                );
            }
        }
    }

    /// Lookups: negative indices count from the end; out of range or fractional ones read NaN;
    /// a where on the index selects; comparisons and lookups have derivative 0.
    #[test]
    fn lookups_and_selection() {
        let table = Table {
            data: (0..6).map(|x| x as f64).collect(),
            shape: vec![2, 3],
        };
        // score + t[head - 1, q - k] if q >= k else score * 2
        let nodes = vec![
            Node::Score,
            Node::Head,
            Node::Const(1.0),
            Node::Binary(Binary::Sub, 1, 2),
            Node::Q,
            Node::K,
            Node::Binary(Binary::Sub, 4, 5),
            Node::Lookup {
                table: 0,
                index: vec![3, 6],
            },
            Node::Binary(Binary::Add, 0, 7),
            Node::Const(2.0),
            Node::Binary(Binary::Mul, 0, 9),
            Node::Binary(Binary::Ge, 4, 5),
            Node::Where(11, 8, 10),
        ];
        let e = ScoreExpr::new(nodes, vec![table], 12).unwrap();
        let v = e.eval_f64(at(2, 0), 0.5);
        assert_eq!((v.value, v.grad), (0.5 + 5.0, 1.0));
        let v = e.eval_f64(at(0, 2), 0.5);
        assert_eq!((v.value, v.grad), (1.0, 2.0));
        // q - k = 5 is past the table's 3 columns: NaN.
        assert!(e.eval_f64(at(5, 0), 0.5).value.is_nan());
        // The f32 strip gives the same, element by element.
        let mut s = [0.5f32; 4];
        let mut g = [0f32; 4];
        let strip = ScoreStrip {
            batch: 1,
            head: 2,
            q0: 0,
            k: 1,
        };
        e.apply(strip, &mut s, Some(&mut g));
        assert_eq!(s, [1.0, 0.5 + 3.0, 0.5 + 4.0, 0.5 + 5.0]);
        assert_eq!(g, [2.0, 1.0, 1.0, 1.0]);
        // A negative index counts from the end: t[1, -1] = 5.
        let nodes = vec![
            Node::Const(1.0),
            Node::Const(-1.0),
            Node::Lookup {
                table: 0,
                index: vec![0, 1],
            },
        ];
        let t = Table {
            data: (0..6).map(|x| x as f64).collect(),
            shape: vec![2, 3],
        };
        let e = ScoreExpr::new(nodes, vec![t], 2).unwrap();
        assert_eq!(e.eval_f64(at(0, 0), 0.0).value, 5.0);
    }

    /// Nodes that read neither the score nor the query row are computed once per strip and
    /// broadcast: `score · t[h - 1, k] + q` over a strip of five rows.
    #[test]
    fn uniform_nodes_broadcast() {
        let t = Table {
            data: (0..6).map(|x| x as f64 + 0.5).collect(),
            shape: vec![2, 3],
        };
        let nodes = vec![
            Node::Score,
            Node::Head,
            Node::Const(1.0),
            Node::Binary(Binary::Sub, 1, 2),
            Node::K,
            Node::Lookup {
                table: 0,
                index: vec![3, 4],
            },
            Node::Binary(Binary::Mul, 0, 5),
            Node::Q,
            Node::Binary(Binary::Add, 6, 7),
        ];
        let e = ScoreExpr::new(nodes, vec![t], 8).unwrap();
        let strip = ScoreStrip {
            batch: 0,
            head: 2,
            q0: 10,
            k: 2,
        };
        let mut s = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        let mut g = [0f32; 5];
        e.apply(strip, &mut s, Some(&mut g));
        // t[1, 2] = 5.5
        assert_eq!(s, [15.5, 22.0, 28.5, 35.0, 41.5]);
        assert_eq!(g, [5.5; 5]);
    }
}
