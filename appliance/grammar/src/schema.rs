//! JSON Schema to [`Grammar`]: every output the grammar allows parses as JSON and validates
//! against the schema.
//!
//! Supported: `type` (one or a list), `properties` (written in the schema's order; `required`
//! ones always, optional ones may be left out), `additionalProperties` (a schema for an object
//! without `properties`; with `properties` no other key is written), `items`, `minItems`,
//! `maxItems`, `minLength`, `maxLength` (in characters), `enum`, `const`, `anyOf`, a one-element `allOf`, `$ref` into `$defs` or
//! `definitions` (recursion included), and annotations (`title`, `description`, `default`,
//! ...). Any other keyword (`pattern`, `format`, `minimum`, `oneOf`, ...) is refused with
//! [`GrammarError::Unsupported`] rather than ignored. Whitespace is allowed where a person would
//! put it (after `{`, `[` and `,`, and before `}` and `]`: at most [`MAX_WS`] bytes; one space
//! after `:`) so the model can lay the JSON out as it learnt to, but not pad it anywhere;
//! numbers take at most 16 digits before and after the point and two in the exponent.

use std::collections::HashMap;

use crate::error::{GrammarError, Result};
use crate::grammar::{ByteSet, Elem, Grammar, RuleId};
use crate::json::Json;

/// Rules a compiled schema may have.
pub const MAX_RULES: usize = 20_000;
/// Whitespace bytes allowed in a row between tokens.
pub const MAX_WS: usize = 16;
/// Largest `minItems` / `maxItems` bound unrolled into the grammar.
pub const MAX_ITEMS_BOUND: u64 = 64;
/// Largest `minLength` / `maxLength` bound unrolled into the grammar.
pub const MAX_LENGTH_BOUND: u64 = 2048;
/// Digits allowed in a number's integer part, and in its fraction.
const MAX_DIGITS: usize = 16;

/// Keywords that describe and constrain nothing.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$defs",
    "definitions",
];

/// Keywords this compiler enforces.
const HANDLED: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "enum",
    "const",
    "anyOf",
    "allOf",
    "$ref",
];

/// A grammar for any JSON object (`response_format: {"type": "json_object"}`).
pub fn json_object() -> Grammar {
    let mut c = Compiler::new(&Json::Null);
    let root = c.object_any();
    c.g.set_root(root);
    c.g
}

/// A grammar for the JSON values `schema` accepts.
pub fn compile(schema: &Json) -> Result<Grammar> {
    let mut c = Compiler::new(schema);
    let root = c.node(schema, "#")?;
    c.g.set_root(root);
    Ok(c.g)
}

/// A grammar for one call of one of `tools` (each a name and the JSON Schema of its
/// arguments): `{"name": "<name>", "arguments": <arguments>}`. With `or_text`, plain text that
/// does not start with `{` or whitespace is allowed instead (the model chooses: OpenAI's
/// `tool_choice: auto`). Each tool's schema is its own document for `$ref`.
pub fn tool_call(tools: &[(&str, &Json)], or_text: bool) -> Result<Grammar> {
    let Some((_, first)) = tools.first() else {
        return Err(bad("#", "no tools"));
    };
    let mut c = Compiler::new(first);
    let ws = c.ws();
    let colon = c.colon();
    let mut alts = Vec::new();
    for (i, (name, parameters)) in tools.iter().enumerate() {
        c.doc = parameters;
        c.refs.clear();
        let arguments = c.node(parameters, &format!("tools[{i}].function.parameters#"))?;
        let mut call = vec![set(ByteSet::byte(b'{')), ws];
        call.extend(lit(br#""name""#));
        call.push(colon);
        call.extend(lit(Json::String((*name).to_owned())
            .to_json_string()
            .as_bytes()));
        call.extend([set(ByteSet::byte(b',')), ws]);
        call.extend(lit(br#""arguments""#));
        call.extend([colon, Elem::Rule(arguments), ws, set(ByteSet::byte(b'}'))]);
        alts.push(call);
    }
    if or_text {
        let text = c.text();
        alts.push(vec![Elem::Rule(text)]);
    }
    let root = c.rule(alts)?;
    c.g.set_root(root);
    Ok(c.g)
}

struct Compiler<'a> {
    g: Grammar,
    doc: &'a Json,
    refs: HashMap<String, RuleId>,
    common: HashMap<&'static str, RuleId>,
}

fn lit(bytes: &[u8]) -> Vec<Elem> {
    bytes.iter().map(|&b| Elem::Set(ByteSet::byte(b))).collect()
}

fn set(s: ByteSet) -> Elem {
    Elem::Set(s)
}

/// The multi-byte characters of well-formed UTF-8, one alternative per lead-byte range (no
/// overlong forms, surrogates or code points past U+10FFFF), so a token may end inside a
/// character and the next one finish it.
fn utf8_multibyte() -> Vec<Vec<Elem>> {
    let cont = set(ByteSet::range(0x80, 0xbf));
    let lead = |lo, hi| set(ByteSet::range(lo, hi));
    vec![
        vec![lead(0xc2, 0xdf), cont],
        vec![lead(0xe0, 0xe0), lead(0xa0, 0xbf), cont],
        vec![lead(0xe1, 0xec), cont, cont],
        vec![lead(0xed, 0xed), lead(0x80, 0x9f), cont],
        vec![lead(0xee, 0xef), cont, cont],
        vec![lead(0xf0, 0xf0), lead(0x90, 0xbf), cont, cont],
        vec![lead(0xf1, 0xf3), cont, cont, cont],
        vec![lead(0xf4, 0xf4), lead(0x80, 0x8f), cont, cont],
    ]
}

impl<'a> Compiler<'a> {
    fn new(doc: &'a Json) -> Compiler<'a> {
        Compiler {
            g: Grammar::default(),
            doc,
            refs: HashMap::new(),
            common: HashMap::new(),
        }
    }

    fn rule(&mut self, alternatives: Vec<Vec<Elem>>) -> Result<RuleId> {
        if self.g.len() >= MAX_RULES {
            return Err(GrammarError::TooLarge { limit: MAX_RULES });
        }
        Ok(self.g.rule(alternatives))
    }

    /// A shared rule, built once.
    fn shared(&mut self, name: &'static str, build: impl FnOnce(&mut Self) -> RuleId) -> RuleId {
        if let Some(&r) = self.common.get(name) {
            return r;
        }
        let r = build(self);
        self.common.insert(name, r);
        r
    }

    /// `""` or up to `n` digits.
    fn digits_upto(&mut self, n: usize) -> RuleId {
        let digit = set(ByteSet::range(b'0', b'9'));
        let mut next = self.g.rule(vec![vec![]]);
        for _ in 0..n {
            next = self.g.rule(vec![vec![], vec![digit, Elem::Rule(next)]]);
        }
        next
    }

    fn ws(&mut self) -> Elem {
        Elem::Rule(self.shared("ws", |c| {
            let space = set(ByteSet::of(b" \t\n\r"));
            let mut next = c.g.rule(vec![vec![]]);
            for _ in 0..MAX_WS {
                next = c.g.rule(vec![vec![], vec![space, Elem::Rule(next)]]);
            }
            next
        }))
    }

    /// One character of a JSON string's content: a well-formed UTF-8 character other than
    /// `"`, `\\` and the controls, or an escape.
    fn string_char(&mut self) -> RuleId {
        self.shared("char", |c| {
            let plain = ByteSet::range(0x20, 0x7f).minus(ByteSet::of(b"\"\\"));
            let hex = set({
                let mut s = ByteSet::range(b'0', b'9');
                for b in (b'a'..=b'f').chain(b'A'..=b'F') {
                    s.insert(b);
                }
                s
            });
            let mut alts = vec![
                vec![set(plain)],
                vec![set(ByteSet::byte(b'\\')), set(ByteSet::of(b"\"\\/bfnrt"))],
                vec![
                    set(ByteSet::byte(b'\\')),
                    set(ByteSet::byte(b'u')),
                    hex,
                    hex,
                    hex,
                    hex,
                ],
            ];
            alts.extend(utf8_multibyte());
            c.g.rule(alts)
        })
    }

    /// Free text: well-formed UTF-8 (tabs and line breaks but no other controls), its first
    /// character neither `{` nor whitespace.
    fn text(&mut self) -> RuleId {
        let mut printable = ByteSet::range(0x20, 0x7e);
        for b in [b'\t', b'\n', b'\r'] {
            printable.insert(b);
        }
        let opening = printable.minus(ByteSet::of(b"{ \t\n\r"));
        // Any character: ASCII from `ascii`, or the same multi-byte forms as in strings.
        let char_of = |c: &mut Self, ascii: ByteSet| {
            let mut alts = vec![vec![set(ascii)]];
            alts.extend(utf8_multibyte());
            c.g.rule(alts)
        };
        let first = char_of(self, opening);
        let any = char_of(self, printable);
        let rest = self.g.declare();
        self.g
            .set_rule(rest, vec![vec![], vec![Elem::Rule(any), Elem::Rule(rest)]]);
        self.g.rule(vec![vec![Elem::Rule(first), Elem::Rule(rest)]])
    }

    /// The rest of a string after its opening quote: any characters, then `"`.
    fn string_rest(&mut self) -> RuleId {
        self.shared("chars", |c| {
            let ch = c.string_char();
            let chars = c.g.declare();
            c.g.set_rule(
                chars,
                vec![lit(b"\""), vec![Elem::Rule(ch), Elem::Rule(chars)]],
            );
            chars
        })
    }

    fn string_any(&mut self) -> RuleId {
        self.shared("string", |c| {
            let rest = c.string_rest();
            c.g.rule(vec![vec![set(ByteSet::byte(b'"')), Elem::Rule(rest)]])
        })
    }

    /// A string of `min..=max` characters (code points, an escape counting as one, as JSON
    /// Schema counts them).
    fn string_of(&mut self, min: u64, max: Option<u64>) -> Result<RuleId> {
        if min == 0 && max.is_none() {
            return Ok(self.string_any());
        }
        let ch = self.string_char();
        let quote = set(ByteSet::byte(b'"'));
        let mut next = match max {
            None => self.string_rest(),
            Some(_) => self.rule(vec![vec![quote]])?,
        };
        for i in (0..max.unwrap_or(min)).rev() {
            let mut alts = Vec::new();
            if i >= min {
                alts.push(vec![quote]);
            }
            alts.push(vec![Elem::Rule(ch), Elem::Rule(next)]);
            next = self.rule(alts)?;
        }
        self.rule(vec![vec![quote, Elem::Rule(next)]])
    }

    fn integer(&mut self) -> RuleId {
        self.shared("integer", |c| {
            let rest = c.digits_upto(MAX_DIGITS - 1);
            let int = c.g.rule(vec![
                lit(b"0"),
                vec![set(ByteSet::range(b'1', b'9')), Elem::Rule(rest)],
            ]);
            let sign = c.g.rule(vec![vec![], lit(b"-")]);
            c.g.rule(vec![vec![Elem::Rule(sign), Elem::Rule(int)]])
        })
    }

    fn number(&mut self) -> RuleId {
        self.shared("number", |c| {
            let int = c.integer();
            let digit = set(ByteSet::range(b'0', b'9'));
            let frac_rest = c.digits_upto(MAX_DIGITS - 1);
            let frac = c.g.rule(vec![
                vec![],
                vec![set(ByteSet::byte(b'.')), digit, Elem::Rule(frac_rest)],
            ]);
            // Two exponent digits at most: every number stays inside an f64 (serde_json refuses
            // `1e364`, Python reads it as infinity).
            let exp_rest = c.digits_upto(1);
            let exp_sign = c.g.rule(vec![vec![], vec![set(ByteSet::of(b"+-"))]]);
            let exp = c.g.rule(vec![
                vec![],
                vec![
                    set(ByteSet::of(b"eE")),
                    Elem::Rule(exp_sign),
                    digit,
                    Elem::Rule(exp_rest),
                ],
            ]);
            c.g.rule(vec![vec![
                Elem::Rule(int),
                Elem::Rule(frac),
                Elem::Rule(exp),
            ]])
        })
    }

    fn boolean(&mut self) -> RuleId {
        self.shared("boolean", |c| c.g.rule(vec![lit(b"true"), lit(b"false")]))
    }

    fn null(&mut self) -> RuleId {
        self.shared("null", |c| c.g.rule(vec![lit(b"null")]))
    }

    /// Any JSON value.
    fn value_any(&mut self) -> RuleId {
        if let Some(&r) = self.common.get("value") {
            return r;
        }
        let value = self.g.declare();
        self.common.insert("value", value);
        let alts = vec![
            vec![Elem::Rule(self.object_any())],
            vec![Elem::Rule(
                self.array_of(value, 0, None).expect("no bounds"),
            )],
            vec![Elem::Rule(self.string_any())],
            vec![Elem::Rule(self.number())],
            vec![Elem::Rule(self.boolean())],
            vec![Elem::Rule(self.null())],
        ];
        self.g.set_rule(value, alts);
        value
    }

    /// Any JSON object.
    fn object_any(&mut self) -> RuleId {
        if let Some(&r) = self.common.get("object") {
            return r;
        }
        let object = self.g.declare();
        self.common.insert("object", object);
        let value = self.value_any();
        let body = self.map_body(value);
        self.g.set_rule(object, vec![body]);
        object
    }

    /// `{` members of string keys and `value` values `}`.
    fn map_body(&mut self, value: RuleId) -> Vec<Elem> {
        let key = self.string_any();
        let ws = self.ws();
        let colon = self.colon();
        let more = self.g.declare();
        let member = [Elem::Rule(key), colon, Elem::Rule(value)];
        let mut again = vec![set(ByteSet::byte(b',')), ws];
        again.extend(member);
        again.push(Elem::Rule(more));
        self.g
            .set_rule(more, vec![vec![ws, set(ByteSet::byte(b'}'))], again]);
        let mut first = member.to_vec();
        first.push(Elem::Rule(more));
        let first = self.g.rule(vec![lit(b"}"), first]);
        vec![set(ByteSet::byte(b'{')), ws, Elem::Rule(first)]
    }

    /// `:` and at most one space.
    fn colon(&mut self) -> Elem {
        Elem::Rule(self.shared("colon", |c| c.g.rule(vec![lit(b":"), lit(b": ")])))
    }

    /// `[` between `min` and `max` (unbounded when `None`) `item`s `]`.
    fn array_of(&mut self, item: RuleId, min: u64, max: Option<u64>) -> Result<RuleId> {
        let ws = self.ws();
        let close = vec![ws, set(ByteSet::byte(b']'))];
        // after[i]: what may follow the i-th item (1-based).
        let bound = max.unwrap_or(min.max(1));
        let mut next: Option<RuleId> = None;
        for i in (1..=bound).rev() {
            let mut alts = Vec::new();
            if i >= min {
                alts.push(close.clone());
            }
            let more_allowed = max.is_none_or(|m| i < m);
            if more_allowed {
                let tail = match next {
                    Some(n) => n,
                    // Unbounded: the last state loops on itself.
                    None => self.g.declare(),
                };
                let mut more = vec![set(ByteSet::byte(b',')), ws, Elem::Rule(item)];
                more.push(Elem::Rule(tail));
                alts.push(more);
                if next.is_none() {
                    self.g.set_rule(tail, alts.clone());
                    next = Some(tail);
                    continue;
                }
            }
            next = Some(self.rule(alts)?);
        }
        let mut body = vec![ws];
        let mut alts = Vec::new();
        if min == 0 {
            alts.push(lit(b"]"));
        }
        if max != Some(0) {
            let mut first = vec![Elem::Rule(item)];
            if let Some(n) = next {
                first.push(Elem::Rule(n));
            }
            alts.push(first);
        }
        let inner = self.rule(alts)?;
        body.push(Elem::Rule(inner));
        let mut seq = vec![set(ByteSet::byte(b'['))];
        seq.extend(body);
        self.rule(vec![seq])
    }

    /// The rule for `schema` at JSON pointer `path`.
    fn node(&mut self, schema: &Json, path: &str) -> Result<RuleId> {
        let members = match schema {
            Json::Bool(true) => return Ok(self.value_any()),
            Json::Bool(false) => {
                return Err(bad(path, "`false` accepts nothing"));
            }
            Json::Object(m) => m,
            _ => return Err(bad(path, "a schema is an object or a boolean")),
        };
        for (k, _) in members {
            if !ANNOTATIONS.contains(&k.as_str()) && !HANDLED.contains(&k.as_str()) {
                return Err(GrammarError::Unsupported {
                    path: path.to_owned(),
                    keyword: k.clone(),
                });
            }
        }
        if let Some(r) = schema.get("$ref") {
            return self.reference(r, path);
        }
        if let Some(c) = schema.get("const") {
            return self.rule(vec![lit(c.to_json_string().as_bytes())]);
        }
        if let Some(e) = schema.get("enum") {
            let Json::Array(values) = e else {
                return Err(bad(path, "`enum` is an array"));
            };
            if values.is_empty() {
                return Err(bad(path, "`enum` is empty"));
            }
            let alts = values
                .iter()
                .map(|v| lit(v.to_json_string().as_bytes()))
                .collect();
            return self.rule(alts);
        }
        if let Some(a) = schema.get("anyOf") {
            let Json::Array(subs) = a else {
                return Err(bad(path, "`anyOf` is an array"));
            };
            if subs.is_empty() {
                return Err(bad(path, "`anyOf` is empty"));
            }
            let mut alts = Vec::new();
            for (i, s) in subs.iter().enumerate() {
                alts.push(vec![Elem::Rule(
                    self.node(s, &format!("{path}/anyOf/{i}"))?,
                )]);
            }
            return self.rule(alts);
        }
        if let Some(a) = schema.get("allOf") {
            return match a {
                Json::Array(subs) if subs.len() == 1 => {
                    self.node(&subs[0], &format!("{path}/allOf/0"))
                }
                _ => Err(GrammarError::Unsupported {
                    path: path.to_owned(),
                    keyword: "allOf (with more than one schema)".to_owned(),
                }),
            };
        }
        // Without `type`, a keyword of one type's means that type (a subset of what the schema
        // allows, so every output still validates); no such keyword means any value.
        let implied = |keys: &[&str]| keys.iter().any(|k| schema.get(k).is_some());
        let types: Vec<&str> = match schema.get("type") {
            None => {
                let by_keywords: [(&[&str], &str); 3] = [
                    (
                        &["properties", "required", "additionalProperties"],
                        "object",
                    ),
                    (&["items", "minItems", "maxItems"], "array"),
                    (&["minLength", "maxLength"], "string"),
                ];
                let found: Vec<&str> = by_keywords
                    .iter()
                    .filter(|(keys, _)| implied(keys))
                    .map(|(_, t)| *t)
                    .collect();
                match found.as_slice() {
                    [] => return Ok(self.value_any()),
                    [one] => vec![*one],
                    _ => {
                        return Err(bad(path, "keywords of several types and no `type`"));
                    }
                }
            }
            Some(Json::String(t)) => vec![t.as_str()],
            Some(Json::Array(ts)) => ts
                .iter()
                .map(|t| t.as_str().ok_or_else(|| bad(path, "`type` lists strings")))
                .collect::<Result<_>>()?,
            Some(_) => return Err(bad(path, "`type` is a string or a list of strings")),
        };
        let mut alts = Vec::new();
        for t in types {
            let r = match t {
                "object" => self.object(schema, path)?,
                "array" => self.array(schema, path)?,
                "string" => {
                    let min = bounded(schema, path, "minLength", MAX_LENGTH_BOUND)?;
                    let max = bounded(schema, path, "maxLength", MAX_LENGTH_BOUND)?;
                    if max.is_some_and(|m| m < min.unwrap_or(0)) {
                        return Err(bad(path, "`maxLength` is below `minLength`"));
                    }
                    self.string_of(min.unwrap_or(0), max)?
                }
                "number" => self.number(),
                "integer" => self.integer(),
                "boolean" => self.boolean(),
                "null" => self.null(),
                other => return Err(bad(path, &format!("unknown type `{other}`"))),
            };
            alts.push(vec![Elem::Rule(r)]);
        }
        if alts.len() == 1 {
            if let Elem::Rule(r) = alts[0][0] {
                return Ok(r);
            }
        }
        self.rule(alts)
    }

    /// A `$ref` to `#` or a JSON pointer into the document, compiled once (so recursion ends).
    fn reference(&mut self, r: &Json, path: &str) -> Result<RuleId> {
        let Some(target) = r.as_str() else {
            return Err(bad(path, "`$ref` is a string"));
        };
        if let Some(&id) = self.refs.get(target) {
            return Ok(id);
        }
        let Some(pointer) = target.strip_prefix('#') else {
            return Err(GrammarError::Unsupported {
                path: path.to_owned(),
                keyword: format!("$ref to another document ({target})"),
            });
        };
        let mut at = self.doc;
        for part in pointer.split('/').skip(1) {
            let key = part.replace("~1", "/").replace("~0", "~");
            at = at
                .get(&key)
                .ok_or_else(|| bad(path, &format!("`$ref` {target} points at nothing")))?;
        }
        let id = self.g.declare();
        self.refs.insert(target.to_owned(), id);
        let inner = self.node(at, target)?;
        self.g.set_rule(id, vec![vec![Elem::Rule(inner)]]);
        Ok(id)
    }

    fn object(&mut self, schema: &Json, path: &str) -> Result<RuleId> {
        let required: Vec<&str> = match schema.get("required") {
            None => Vec::new(),
            Some(Json::Array(r)) => r
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| bad(path, "`required` lists strings"))
                })
                .collect::<Result<_>>()?,
            Some(_) => return Err(bad(path, "`required` is an array")),
        };
        let props = match schema.get("properties") {
            None => {
                if let Some(name) = required.first() {
                    return Err(bad(
                        path,
                        &format!("`{name}` is required but not in `properties`"),
                    ));
                }
                return match schema.get("additionalProperties") {
                    None | Some(Json::Bool(true)) => Ok(self.object_any()),
                    Some(Json::Bool(false)) => {
                        let ws = self.ws();
                        self.rule(vec![vec![
                            set(ByteSet::byte(b'{')),
                            ws,
                            set(ByteSet::byte(b'}')),
                        ]])
                    }
                    Some(sub) => {
                        let value = self.node(sub, &format!("{path}/additionalProperties"))?;
                        let body = self.map_body(value);
                        self.rule(vec![body])
                    }
                };
            }
            Some(Json::Object(p)) => p,
            Some(_) => return Err(bad(path, "`properties` is an object")),
        };
        if let Some(name) = required
            .iter()
            .find(|r| !props.iter().any(|(k, _)| k == *r))
        {
            return Err(bad(
                path,
                &format!("`{name}` is required but not in `properties`"),
            ));
        }
        let mut values = Vec::with_capacity(props.len());
        for (name, sub) in props {
            let value = self.node(sub, &format!("{path}/properties/{name}"))?;
            let key = Json::String(name.clone()).to_json_string();
            values.push((key, value, required.contains(&name.as_str())));
        }
        let ws = self.ws();
        let colon = self.colon();
        let n = values.len();
        // first[i] / rest[i]: properties i.. still to write, before / after the first written.
        let mut first = vec![0; n + 1];
        let mut rest = vec![0; n + 1];
        first[n] = self.rule(vec![lit(b"}")])?;
        rest[n] = self.rule(vec![vec![ws, set(ByteSet::byte(b'}'))]])?;
        for i in (0..n).rev() {
            for leading in [true, false] {
                let mut alts = Vec::new();
                for (j, (key, value, _)) in values.iter().enumerate().skip(i) {
                    let mut seq = if leading {
                        Vec::new()
                    } else {
                        vec![set(ByteSet::byte(b',')), ws]
                    };
                    seq.extend(lit(key.as_bytes()));
                    seq.extend([colon, Elem::Rule(*value)]);
                    seq.push(Elem::Rule(rest[j + 1]));
                    alts.push(seq);
                    if values[j].2 {
                        break; // a required property cannot be skipped
                    }
                }
                if values[i..].iter().all(|v| !v.2) {
                    alts.push(if leading {
                        lit(b"}")
                    } else {
                        vec![ws, set(ByteSet::byte(b'}'))]
                    });
                }
                let r = self.rule(alts)?;
                if leading {
                    first[i] = r;
                } else {
                    rest[i] = r;
                }
            }
        }
        self.rule(vec![vec![
            set(ByteSet::byte(b'{')),
            ws,
            Elem::Rule(first[0]),
        ]])
    }

    fn array(&mut self, schema: &Json, path: &str) -> Result<RuleId> {
        let min = bounded(schema, path, "minItems", MAX_ITEMS_BOUND)?.unwrap_or(0);
        let max = bounded(schema, path, "maxItems", MAX_ITEMS_BOUND)?;
        if max.is_some_and(|m| m < min) {
            return Err(bad(path, "`maxItems` is below `minItems`"));
        }
        let item = match schema.get("items") {
            None => self.value_any(),
            Some(s) => self.node(s, &format!("{path}/items"))?,
        };
        self.array_of(item, min, max)
    }
}

/// The non-negative integer `keyword` of `schema`, refused above `limit` (the grammar unrolls
/// it).
fn bounded(schema: &Json, path: &str, keyword: &str, limit: u64) -> Result<Option<u64>> {
    match schema.get(keyword) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= limit => Ok(Some(n)),
            Some(_) => Err(GrammarError::Unsupported {
                path: path.to_owned(),
                keyword: format!("{keyword} above {limit}"),
            }),
            None => Err(bad(path, &format!("`{keyword}` is a non-negative integer"))),
        },
    }
}

fn bad(path: &str, reason: &str) -> GrammarError {
    GrammarError::BadSchema {
        path: path.to_owned(),
        reason: reason.to_owned(),
    }
}
