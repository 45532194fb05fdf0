//! The NetConf's shape as serde decodes it (JSON key names and value kinds, nested structs
//! included), read off the derived `Deserialize` impls by a deserializer that records what
//! each one asks for. The case-folding key lists come from here, and a test in `gotypes`
//! ties Go's type schema to it, so a field is declared once, on the serde struct.

use serde::de::value::{Error, StrDeserializer};
use serde::de::{DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::forward_to_deserialize_any;

/// What a serde field decodes from JSON.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    Str,
    Int,
    Bool,
    /// A sequence of the given shape.
    Seq(Box<Shape>),
    /// A map of arbitrary keys.
    Map,
    /// Anything (`serde_json::Value`), or a kind this tracer does not tell apart.
    Any,
    Opt(Box<Shape>),
    /// A struct: its fields by JSON key, in declaration order.
    Struct(Vec<(&'static str, Shape)>),
}

impl Shape {
    /// The struct fields, looking through `Option`; empty for anything else.
    pub(super) fn fields(&self) -> &[(&'static str, Shape)] {
        match self {
            Shape::Struct(fields) => fields,
            Shape::Opt(inner) => inner.fields(),
            _ => &[],
        }
    }
}

/// The shape `T` decodes.
pub(super) fn shape_of<T: DeserializeOwned>() -> Shape {
    let mut slot = None;
    // The decode itself succeeds or fails by `T`'s rules; only what it asked for matters.
    let _ = T::deserialize(Tracer { slot: &mut slot });
    slot.unwrap_or(Shape::Any)
}

/// A deserializer that answers every request with an empty value and notes what was asked.
struct Tracer<'a> {
    slot: &'a mut Option<Shape>,
}

impl Tracer<'_> {
    fn record(self, shape: Shape) {
        *self.slot = Some(shape);
    }
}

impl<'de> Deserializer<'de> for Tracer<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.record(Shape::Any);
        visitor.visit_unit()
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.record(Shape::Bool);
        visitor.visit_bool(false)
    }

    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.record(Shape::Int);
        visitor.visit_i64(0)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.record(Shape::Str);
        visitor.visit_str("")
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let mut inner = None;
        let r = visitor.visit_some(Tracer { slot: &mut inner });
        self.record(Shape::Opt(Box::new(inner.unwrap_or(Shape::Any))));
        r
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let mut item = None;
        let r = visitor.visit_seq(OneItem {
            slot: &mut item,
            given: false,
        });
        self.record(Shape::Seq(Box::new(item.unwrap_or(Shape::Any))));
        r
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.record(Shape::Map);
        visitor.visit_map(Fields {
            names: &[],
            next: 0,
            out: &mut Vec::new(),
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        names: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let mut out = Vec::new();
        let r = visitor.visit_map(Fields {
            names,
            next: 0,
            out: &mut out,
        });
        self.record(Shape::Struct(out));
        r
    }

    forward_to_deserialize_any! {
        i8 i16 i32 i128 u8 u16 u32 u64 u128 f32 f64 char bytes byte_buf unit unit_struct
        newtype_struct tuple tuple_struct enum identifier ignored_any
    }
}

/// A sequence of one traced item.
struct OneItem<'a> {
    slot: &'a mut Option<Shape>,
    given: bool,
}

impl<'de> SeqAccess<'de> for OneItem<'_> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        if self.given {
            return Ok(None);
        }
        self.given = true;
        seed.deserialize(Tracer {
            slot: &mut *self.slot,
        })
        .map(Some)
    }
}

/// A struct's fields, each given once, its value traced.
struct Fields<'a> {
    names: &'static [&'static str],
    next: usize,
    out: &'a mut Vec<(&'static str, Shape)>,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        match self.names.get(self.next) {
            Some(&name) => seed.deserialize(StrDeserializer::new(name)).map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let name = self.names.get(self.next).copied().unwrap_or_default();
        self.next += 1;
        let mut slot = None;
        let value = seed.deserialize(Tracer { slot: &mut slot })?;
        self.out.push((name, slot.unwrap_or(Shape::Any)));
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[allow(dead_code)]
    #[derive(Default, Deserialize)]
    #[serde(default)]
    struct Inner {
        #[serde(rename = "Flag")]
        flag: bool,
    }

    #[allow(dead_code)]
    #[derive(Deserialize)]
    struct Outer {
        #[serde(rename = "camelCase")]
        s: String,
        n: i64,
        list: Vec<String>,
        maybe: Option<String>,
        any: serde_json::Value,
        map: Option<serde_json::Map<String, serde_json::Value>>,
        inner: Inner,
    }

    #[test]
    fn traces_names_kinds_and_nesting() {
        let shape = shape_of::<Outer>();
        assert_eq!(
            shape,
            Shape::Struct(vec![
                ("camelCase", Shape::Str),
                ("n", Shape::Int),
                ("list", Shape::Seq(Box::new(Shape::Str))),
                ("maybe", Shape::Opt(Box::new(Shape::Str))),
                ("any", Shape::Any),
                ("map", Shape::Opt(Box::new(Shape::Map))),
                ("inner", Shape::Struct(vec![("Flag", Shape::Bool)])),
            ])
        );
        assert_eq!(shape.fields()[6].1.fields(), &[("Flag", Shape::Bool)]);
        assert!(Shape::Int.fields().is_empty());
    }
}
