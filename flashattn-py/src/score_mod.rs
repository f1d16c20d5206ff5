//! `flashattn._flashattn.ScoreMod`: a score function traced by the Python layer
//! (`flashattn.flex_attention(score_mod=f)`) into an expression program, evaluated in Rust with
//! its derivative ([`flashattn::score_expr::ScoreExpr`]) and handed to the attention calls through
//! their options.

use flashattn::score_expr::{Binary, Node, ScoreExpr, Table, Unary};
use flashattn::ScoreFn;
use pyo3::prelude::*;

use crate::errors::BindError;

/// A traced score function (immutable, shared between calls and threads).
#[pyclass(frozen, module = "flashattn._flashattn", name = "ScoreMod")]
pub struct PyScoreMod {
    pub(crate) inner: ScoreFn,
    nodes: usize,
}

fn unary(name: &str) -> Option<Unary> {
    Some(match name {
        "neg" => Unary::Neg,
        "abs" => Unary::Abs,
        "exp" => Unary::Exp,
        "log" => Unary::Log,
        "tanh" => Unary::Tanh,
        "sigmoid" => Unary::Sigmoid,
        "sqrt" => Unary::Sqrt,
        "floor" => Unary::Floor,
        "not" => Unary::Not,
        _ => return None,
    })
}

fn binary(name: &str) -> Option<Binary> {
    Some(match name {
        "add" => Binary::Add,
        "sub" => Binary::Sub,
        "mul" => Binary::Mul,
        "div" => Binary::Div,
        "floordiv" => Binary::FloorDiv,
        "rem" => Binary::Rem,
        "pow" => Binary::Pow,
        "min" => Binary::Min,
        "max" => Binary::Max,
        "lt" => Binary::Lt,
        "le" => Binary::Le,
        "gt" => Binary::Gt,
        "ge" => Binary::Ge,
        "eq" => Binary::Eq,
        "ne" => Binary::Ne,
        "and" => Binary::And,
        "or" => Binary::Or,
        _ => return None,
    })
}

/// One traced node: `(op, args, constant)`; `lookup`'s first argument is the table's index, the
/// rest its index nodes.
fn node(i: usize, (op, args, c): (String, Vec<usize>, f64)) -> Result<Node, BindError> {
    let want = |n: usize| -> Result<(), BindError> {
        if args.len() == n {
            Ok(())
        } else {
            Err(BindError::Value(format!(
                "score_mod node {i} ({op}) has {} arguments, not {n}",
                args.len()
            )))
        }
    };
    let n = match op.as_str() {
        "score" => Node::Score,
        "b" => Node::Batch,
        "h" => Node::Head,
        "q_idx" => Node::Q,
        "kv_idx" => Node::K,
        "const" => Node::Const(c),
        "where" => {
            want(3)?;
            Node::Where(args[0], args[1], args[2])
        }
        "lookup" if !args.is_empty() => Node::Lookup {
            table: args[0],
            index: args[1..].to_vec(),
        },
        name => match (unary(name), binary(name)) {
            (Some(u), _) => {
                want(1)?;
                Node::Unary(u, args[0])
            }
            (_, Some(b)) => {
                want(2)?;
                Node::Binary(b, args[0], args[1])
            }
            _ => {
                return Err(BindError::Value(format!(
                    "score_mod node {i}: unknown operation {name:?}"
                )))
            }
        },
    };
    Ok(n)
}

#[pymethods]
impl PyScoreMod {
    /// Builds the program: `nodes` as `(op, args, constant)`, `tables` as `(values, shape)`
    /// (row-major), `output` the node whose value is the function's.
    #[staticmethod]
    fn from_program(
        nodes: Vec<(String, Vec<usize>, f64)>,
        tables: Vec<(Vec<f64>, Vec<usize>)>,
        output: usize,
    ) -> PyResult<Self> {
        let n = nodes.len();
        let nodes = nodes
            .into_iter()
            .enumerate()
            .map(|(i, x)| node(i, x))
            .collect::<Result<Vec<_>, _>>()?;
        let tables = tables
            .into_iter()
            .map(|(data, shape)| Table { data, shape })
            .collect();
        let expr = ScoreExpr::new(nodes, tables, output).map_err(BindError::Lib)?;
        Ok(PyScoreMod {
            inner: ScoreFn::new(expr),
            nodes: n,
        })
    }

    /// Value and derivative of the function at one score and index, in f64 (tests).
    fn eval(&self, score: f64, b: usize, h: usize, q: usize, k: usize) -> (f64, f64) {
        let at = flashattn::MaskIndex {
            batch: b,
            head: h,
            q,
            k,
        };
        let v = self.inner.eval_f64(at, score);
        (v.value, v.grad)
    }

    fn __len__(&self) -> usize {
        self.nodes
    }
}
