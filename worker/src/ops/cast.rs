//! cast: converts a tensor's elements to another numeric dtype. Text (`bytes`) converts to
//! and from nothing else here: a text field becomes a bytes tensor in `apply`.
//!
//! Semantics (unlike numpy's `astype`, nothing wraps around):
//! - to an integer type, values saturate at the type's range, floats truncate toward zero and
//!   NaN becomes 0 (Rust's `as`), integers clamp;
//! - to a float type, values round to nearest; out-of-range values become ±infinity (f16 tops
//!   out at 65504);
//! - to the same dtype, the tensor is returned without copying.

use bytes::Bytes;
use half::f16;
use stoker_api::{DType, Layout, Tensor};

use super::OpError;

pub fn cast(tensor: &Tensor, to: DType) -> Result<Tensor, OpError> {
    let from = tensor.dtype;
    if from == to {
        return Ok(tensor.clone());
    }
    if !from.is_fixed() || !to.is_fixed() {
        return Err(OpError::InvalidParameter(format!(
            "cannot cast {} to {}: text and numbers do not convert",
            from.numpy_name(),
            to.numpy_name()
        )));
    }
    if tensor.data.len() != tensor.len() * from.size() {
        return Err(OpError::InvalidParameter(format!("{from:?} {:?} has {} bytes", tensor.shape, tensor.data.len())));
    }
    let mut out = Vec::with_capacity(tensor.len() * to.size());
    for e in tensor.data.chunks_exact(from.size()) {
        write(&mut out, to, read(from, e));
    }
    Ok(Tensor { dtype: to, shape: tensor.shape.clone(), data: Bytes::from(out), layout: Layout::Dense })
}

/// Integers stay integers so int64 values above 2^53 cast between integer types exactly.
#[derive(Clone, Copy)]
enum Value {
    Int(i64),
    Float(f64),
}

fn read(dtype: DType, b: &[u8]) -> Value {
    match dtype {
        DType::Uint8 => Value::Int(i64::from(b[0])),
        DType::Int32 => Value::Int(i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        DType::Int64 => Value::Int(i64::from_le_bytes(b.try_into().unwrap_or_default())),
        DType::Float16 => Value::Float(f16::from_le_bytes([b[0], b[1]]).to_f64()),
        DType::Float32 => Value::Float(f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        DType::Float64 => Value::Float(f64::from_le_bytes(b.try_into().unwrap_or_default())),
        DType::Bytes => unreachable!("cast checks for text first"),
    }
}

fn write(out: &mut Vec<u8>, dtype: DType, v: Value) {
    match dtype {
        DType::Uint8 => out.push(match v {
            Value::Int(i) => i.clamp(0, 255) as u8,
            Value::Float(f) => f as u8,
        }),
        DType::Int32 => out.extend_from_slice(
            &match v {
                Value::Int(i) => i.clamp(i32::MIN.into(), i32::MAX.into()) as i32,
                Value::Float(f) => f as i32,
            }
            .to_le_bytes(),
        ),
        DType::Int64 => out.extend_from_slice(
            &match v {
                Value::Int(i) => i,
                Value::Float(f) => f as i64,
            }
            .to_le_bytes(),
        ),
        DType::Float16 => out.extend_from_slice(&f16::from_f64(as_f64(v)).to_le_bytes()),
        DType::Float32 => out.extend_from_slice(&(as_f64(v) as f32).to_le_bytes()),
        DType::Float64 => out.extend_from_slice(&as_f64(v).to_le_bytes()),
        DType::Bytes => unreachable!("cast checks for text first"),
    }
}

fn as_f64(v: Value) -> f64 {
    match v {
        Value::Int(i) => i as f64,
        Value::Float(f) => f,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(values: &[f32]) -> Tensor {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor::new(DType::Float32, vec![values.len()], Bytes::from(data)).unwrap()
    }

    #[test]
    fn floats_saturate_into_integers() {
        let t = f32s(&[-3.7, 0.0, 1.9, 254.6, 300.0, f32::NAN, f32::INFINITY]);
        assert_eq!(&cast(&t, DType::Uint8).unwrap().data[..], &[0, 0, 1, 254, 255, 0, 255]);
        let i32s = cast(&t, DType::Int32).unwrap();
        let got: Vec<i32> = i32s.data.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(got, vec![-3, 0, 1, 254, 300, 0, i32::MAX]);
    }

    #[test]
    fn integers_clamp_and_round_trip() {
        let data: Vec<u8> = [-5i64, 70_000, i64::MAX].iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = Tensor::new(DType::Int64, vec![3], Bytes::from(data)).unwrap();
        assert_eq!(&cast(&t, DType::Uint8).unwrap().data[..], &[0, 255, 255]);
        let back = cast(&cast(&t, DType::Int32).unwrap(), DType::Int64).unwrap();
        let got: Vec<i64> = back.data.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(got, vec![-5, 70_000, i64::from(i32::MAX)]);
        let u8s = Tensor::new(DType::Uint8, vec![2, 2], Bytes::from_static(&[0, 1, 128, 255])).unwrap();
        assert_eq!(cast(&cast(&u8s, DType::Float16).unwrap(), DType::Uint8).unwrap(), u8s);
        assert_eq!(cast(&cast(&u8s, DType::Float64).unwrap(), DType::Uint8).unwrap(), u8s);
    }

    #[test]
    fn float_narrowing_rounds_and_overflows_to_infinity() {
        let h = cast(&f32s(&[1.0 + 1.0 / 4096.0, 1e6]), DType::Float16).unwrap();
        let got: Vec<f32> = h.data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        assert_eq!(got, vec![1.0, f32::INFINITY]);
        let same = f32s(&[1.5]);
        assert_eq!(cast(&same, DType::Float32).unwrap(), same);
    }
}
