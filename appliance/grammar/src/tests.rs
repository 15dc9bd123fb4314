//! Grammar, schema and mask tests: fixed cases, random walks through each grammar (every
//! output must parse and validate), and the trie mask against a brute-force one.

use serde_json::{json, Value};

use crate::*;

/// The grammar of `schema`. `json!` sorts object keys, so a test that depends on property
/// order writes its schema as text and uses [`ordered`].
fn grammar(schema: Value) -> Grammar {
    compile(&Json::from(&schema)).expect("schema compiles")
}

/// The grammar of a schema written as text, properties in the order written.
fn ordered(schema: &str) -> Grammar {
    compile(&serde_json::from_str::<Json>(schema).expect("JSON")).expect("schema compiles")
}

fn matches(g: &Grammar, text: &str) -> bool {
    let mut m = Matcher::new(g);
    m.accept_bytes(g, text.as_bytes()) && m.is_complete()
}

/// A small validator for the keywords the compiler supports, written from the JSON Schema
/// text (not from the compiler) to check its outputs.
fn valid(doc: &Value, schema: &Value, v: &Value) -> bool {
    let Some(s) = schema.as_object() else {
        return schema == &json!(true);
    };
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let target = doc
            .pointer(r.trim_start_matches('#'))
            .expect("ref resolves");
        return valid(doc, target, v);
    }
    if let Some(c) = s.get("const") {
        return c == v;
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        return e.contains(v);
    }
    if let Some(a) = s.get("anyOf").and_then(Value::as_array) {
        return a.iter().any(|sub| valid(doc, sub, v));
    }
    if let Some(t) = s.get("type") {
        let types: Vec<&str> = match t {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => panic!("bad type"),
        };
        let ok = types.iter().any(|t| match *t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "number" => v.is_number(),
            "integer" => v.is_i64() || v.is_u64(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            _ => false,
        });
        if !ok {
            return false;
        }
    }
    if let Some(o) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for r in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if !o.contains_key(r.as_str().unwrap()) {
                return false;
            }
        }
        for (k, val) in o {
            let sub = match props.and_then(|p| p.get(k)) {
                Some(sub) => sub,
                None => match s.get("additionalProperties") {
                    Some(Value::Bool(false)) => return false,
                    Some(ap) => ap,
                    None => &json!(true),
                },
            };
            if !valid(doc, sub, val) {
                return false;
            }
        }
    }
    if let Some(a) = v.as_array() {
        if s.get("minItems")
            .and_then(Value::as_u64)
            .is_some_and(|m| (a.len() as u64) < m)
            || s.get("maxItems")
                .and_then(Value::as_u64)
                .is_some_and(|m| (a.len() as u64) > m)
        {
            return false;
        }
        if let Some(items) = s.get("items") {
            return a.iter().all(|x| valid(doc, items, x));
        }
    }
    true
}

/// A tiny xorshift generator: the walks are reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A random output of `g`: random allowed bytes, leaning towards closing once it is long.
fn walk(g: &Grammar, rng: &mut Rng) -> Option<String> {
    let mut m = Matcher::new(g);
    let mut out = Vec::new();
    for _ in 0..4000 {
        if m.is_complete() && (!m.can_continue() || rng.below(4) == 0 || out.len() > 300) {
            return Some(String::from_utf8(out).expect("the grammar keeps UTF-8 whole"));
        }
        let choices: Vec<u8> = (0..=255u8).filter(|&b| m.after(g, b).is_some()).collect();
        assert!(
            !choices.is_empty(),
            "stuck after {:?}",
            String::from_utf8_lossy(&out)
        );
        let closing: Vec<u8> = choices
            .iter()
            .copied()
            .filter(|b| b"\"}]".contains(b) || b.is_ascii_digit() && out.len() > 600)
            .collect();
        let b = if out.len() > 150 && !closing.is_empty() && rng.below(3) != 0 {
            closing[rng.below(closing.len())]
        } else {
            choices[rng.below(choices.len())]
        };
        assert!(m.accept(g, b));
        out.push(b);
    }
    None
}

fn check_walks(schema: Value, n: usize) {
    let g = grammar(schema.clone());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut done = 0;
    for _ in 0..n {
        let Some(text) = walk(&g, &mut rng) else {
            continue;
        };
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} does not parse: {e}"));
        assert!(valid(&schema, &schema, &v), "{text} breaks {schema}");
        done += 1;
    }
    assert!(done >= n * 9 / 10, "only {done} of {n} walks ended");
}

#[test]
fn json_object_accepts_objects_and_nothing_else() {
    let g = json_object();
    for ok in [
        "{}",
        "{ }",
        r#"{"a": [1, -2.5e3, "x\u00e9\n", true, null], "b": {"c": {}}}"#,
        "{\n  \"名前\": \"東京\"\n}",
    ] {
        assert!(matches(&g, ok), "{ok}");
    }
    for bad in [
        "[1]",
        "\"a\"",
        r#"{"a" 1}"#,
        r#"{"a": 01}"#,
        r#"{"a": 1,}"#,
        r#"{a: 1}"#,
        "{\"a\": \"\u{1}\"}",
        r#"{"a": tru}"#,
        r#"{"a": "x"#,
    ] {
        assert!(!matches(&g, bad), "{bad}");
    }
    // Invalid UTF-8 inside a string is refused byte by byte.
    let mut m = Matcher::new(&g);
    assert!(m.accept_bytes(&g, b"{\"a\": \""));
    assert!(!m.clone().accept_bytes(&g, &[0xff]));
    assert!(!m.clone().accept_bytes(&g, &[0xc3, 0x28]));
    assert!(m.accept_bytes(&g, &[0xc3, 0xa9]));
}

#[test]
fn properties_follow_the_schema_order_and_required_ones_are_written() {
    let g = ordered(
        r#"{"type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["name", "age"]}"#,
    );
    assert!(matches(&g, r#"{"name": "Ada", "age": 36}"#));
    assert!(matches(&g, r#"{"name":"Ada","age":36,"email":"a@b"}"#));
    assert!(!matches(&g, r#"{"name": "Ada"}"#), "age is required");
    assert!(
        !matches(&g, r#"{"age": 36, "name": "Ada"}"#),
        "schema order"
    );
    assert!(!matches(&g, r#"{"name": "Ada", "age": 3.5}"#), "an integer");
    assert!(
        !matches(&g, r#"{"name": "Ada", "age": 36, "x": 1}"#),
        "no other key"
    );
    // Declaration order, not alphabetical: the ordered Json keeps it through serde.
    let schema: Json = serde_json::from_str(
        r#"{"type":"object","properties":{"z":{"type":"null"},"a":{"type":"null"}},"required":["z","a"]}"#,
    )
    .unwrap();
    let g = compile(&schema).unwrap();
    assert!(matches(&g, r#"{"z": null, "a": null}"#));
    assert!(!matches(&g, r#"{"a": null, "z": null}"#));
}

#[test]
fn optional_properties_may_be_skipped_anywhere() {
    let g = grammar(json!({
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"type": "number"}}
    }));
    for ok in [
        "{}",
        r#"{"b": null}"#,
        r#"{"a": true, "c": 1.5}"#,
        r#"{"c": -0.25E+2}"#,
    ] {
        assert!(matches(&g, ok), "{ok}");
    }
    assert!(!matches(&g, r#"{, "c": 1}"#));
    assert!(!matches(&g, r#"{"a": true,}"#));
}

#[test]
fn enums_consts_unions_and_references() {
    let schema = json!({
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "label": {"enum": ["leaf", "branch", 3]},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}
                },
                "required": ["label"]
            }
        },
        "type": "object",
        "properties": {
            "kind": {"const": "tree"},
            "root": {"$ref": "#/$defs/Node"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}
        },
        "required": ["kind", "root", "note"]
    });
    let g = ordered(&schema.to_string());
    assert!(matches(
        &g,
        r#"{"kind": "tree", "note": null, "root": {"children": [{"label": 3}, {"children": [], "label": "leaf"}], "label": "branch"}}"#
    ));
    assert!(!matches(
        &g,
        r#"{"kind": "bush", "note": null, "root": {"label": "leaf"}}"#
    ));
    assert!(!matches(
        &g,
        r#"{"kind": "tree", "note": null, "root": {"label": "twig"}}"#
    ));
    assert!(!matches(
        &g,
        r#"{"kind": "tree", "note": 1, "root": {"label": "leaf"}}"#
    ));
    check_walks(schema, 60);
}

#[test]
fn array_bounds_are_unrolled() {
    let g = grammar(
        json!({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}),
    );
    assert!(!matches(&g, "[1]"));
    assert!(matches(&g, "[1, 2]"));
    assert!(matches(&g, "[1,2,3]"));
    assert!(!matches(&g, "[1, 2, 3, 4]"));
    let g = grammar(json!({"type": "array", "minItems": 1}));
    assert!(!matches(&g, "[]"));
    assert!(matches(&g, r#"[{}, [], "x", 1, false]"#));
    let g = grammar(json!({"type": "array", "maxItems": 0}));
    assert!(matches(&g, "[ ]"));
    assert!(!matches(&g, "[1]"));
}

#[test]
fn string_lengths_count_characters() {
    let g = grammar(json!({"type": "string", "minLength": 2, "maxLength": 3}));
    assert!(!matches(&g, r#""a""#));
    assert!(matches(&g, r#""ab""#));
    assert!(matches(&g, r#""é\n東""#), "three characters, one an escape");
    assert!(!matches(&g, r#""abcd""#));
    // Without `type`, length keywords mean a string.
    let g = grammar(json!({"maxLength": 1}));
    assert!(matches(&g, r#""a""#));
    assert!(!matches(&g, "1"));
    check_walks(
        json!({"type": "string", "minLength": 5, "maxLength": 40}),
        40,
    );
    check_walks(json!({"type": "string", "minLength": 3}), 40);
}

#[test]
fn whitespace_is_allowed_where_a_person_puts_it() {
    let g = json_object();
    assert!(matches(
        &g,
        "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {}\n}"
    ));
    assert!(!matches(&g, r#"{"a" : 1}"#), "none before a colon");
    assert!(!matches(&g, r#"{"a":  1}"#), "one space after it");
    assert!(!matches(&g, r#"{"a": 1 , "b": 2}"#), "none before a comma");
}

#[test]
fn whitespace_and_numbers_are_bounded() {
    let g = json_object();
    let spaces = " ".repeat(MAX_WS);
    assert!(matches(&g, &format!("{{{spaces}}}")));
    assert!(!matches(&g, &format!("{{ {spaces}}}")));
    let g = grammar(json!({"type": "number"}));
    assert!(matches(&g, "1234567890123456.25"));
    assert!(!matches(&g, "12345678901234567"));
}

#[test]
fn what_cannot_be_enforced_is_refused_by_name() {
    let err = |s: Value| compile(&Json::from(&s)).unwrap_err();
    assert_eq!(
        err(json!({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}})),
        GrammarError::Unsupported {
            path: "#/properties/age".into(),
            keyword: "minimum".into()
        }
    );
    for kw in ["pattern", "format", "oneOf", "not", "uniqueItems"] {
        let e = err(json!({ kw: "x" }));
        assert!(e.to_string().contains(kw), "{e}");
    }
    assert!(matches!(
        err(json!({"type": "thing"})),
        GrammarError::BadSchema { .. }
    ));
    assert!(matches!(
        err(json!({"type": "object", "properties": {}, "required": ["a"]})),
        GrammarError::BadSchema { .. }
    ));
    assert!(matches!(
        err(json!({"$ref": "#/$defs/Missing"})),
        GrammarError::BadSchema { .. }
    ));
    assert!(matches!(err(json!(false)), GrammarError::BadSchema { .. }));
    assert!(matches!(
        err(json!({"type": "array", "maxItems": 1000})),
        GrammarError::Unsupported { .. }
    ));
}

#[test]
fn random_outputs_parse_and_validate() {
    check_walks(json!(true), 60);
    check_walks(json!({"type": "object"}), 60);
    check_walks(
        json!({
            "title": "Person", "description": "what pydantic writes",
            "type": "object",
            "properties": {
                "name": {"title": "Name", "type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                "scores": {"type": "object", "additionalProperties": {"type": "number"}},
                "nick": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null},
                "alive": {"type": ["boolean", "null"]}
            },
            "required": ["name", "tags"]
        }),
        80,
    );
}

/// A toy vocabulary: the trie's mask must equal trying every token on its own.
#[test]
fn trie_mask_equals_brute_force() {
    let pieces: Vec<&[u8]> = vec![
        b"{",
        b"}",
        b"\"",
        b"{\"",
        b"\":",
        b"\": ",
        b" ",
        b"\n",
        b"name",
        b"na",
        b"me",
        b"\",",
        b"1",
        b"12",
        b"-",
        b".",
        b"true",
        b"tr",
        b"ue",
        b"null",
        b"x",
        b"\xc3",
        b"\xa9",
        b"\xc3\xa9",
        b"]",
        b"[",
        b"\"}",
        b"age",
        b"\"age",
        b"",
        b"\xff",
    ];
    let eog = pieces.len() as u32;
    let vocab = pieces.len() + 1;
    let trie = TokenTrie::new(
        pieces.iter().enumerate().map(|(i, p)| (i as u32, *p)),
        &[eog],
        vocab,
    );
    let g = std::sync::Arc::new(grammar(json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": ["integer", "null"]}},
        "required": ["name"]
    })));
    let mut states = States::new(g.clone());
    let mut rng = Rng(7);
    let mut allowed = Vec::new();
    for _ in 0..40 {
        let mut m = Matcher::new(&g);
        let mut fed = Vec::new();
        for _ in 0..30 {
            // The interned walk from the start state reaches the same state as the matcher.
            let start = states.start();
            let s = states.steps(start, &fed).unwrap();
            assert_eq!(states.matcher(s), &m);
            trie.allowed(&mut states, s, &mut allowed);
            for (i, p) in pieces.iter().enumerate() {
                let brute = !p.is_empty() && m.clone().accept_bytes(&g, p);
                assert_eq!(allowed[i], brute, "token {:?}", String::from_utf8_lossy(p));
            }
            assert_eq!(allowed[eog as usize], m.is_complete());
            let ok: Vec<usize> = (0..pieces.len()).filter(|&i| allowed[i]).collect();
            if ok.is_empty() {
                break;
            }
            let piece = pieces[ok[rng.below(ok.len())]];
            assert!(m.accept_bytes(&g, piece));
            fed.extend_from_slice(piece);
        }
    }
}

#[test]
fn constrained_masks_logits_and_finishes() {
    let pieces: Vec<&[u8]> = vec![b"{}", b"{", b"}", b"hello"];
    let trie = std::sync::Arc::new(TokenTrie::new(
        pieces.iter().enumerate().map(|(i, p)| (i as u32, *p)),
        &[4],
        5,
    ));
    let mut c = Constrained::new(std::sync::Arc::new(json_object()), trie);
    let mut logits = vec![0.0; 5];
    assert!(c.mask(&mut logits));
    assert_eq!(
        logits.iter().map(|l| l.is_finite()).collect::<Vec<_>>(),
        [true, true, false, false, false]
    );
    assert!(!c.accept(b"hello"));
    assert!(c.accept(b"{}"));
    assert!(c.is_complete() && c.is_finished());
}

#[test]
fn tool_calls_name_a_tool_and_follow_its_parameters() {
    let weather = serde_json::from_str::<Json>(
        r#"{"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"]}"#,
    )
    .unwrap();
    let time = serde_json::from_str::<Json>(
        r##"{"$defs": {"Zone": {"type": "string", "maxLength": 8}}, "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"]}"##,
    )
    .unwrap();
    let tools = [("get_weather", &weather), ("get_time", &time)];
    let g = tool_call(&tools, false).unwrap();
    assert!(matches(
        &g,
        r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}"#
    ));
    assert!(matches(
        &g,
        r#"{"name":"get_time","arguments":{"zone":"UTC"}}"#
    ));
    assert!(!matches(
        &g,
        r#"{"name": "get_time", "arguments": {"city": "Paris"}}"#
    ));
    assert!(!matches(&g, r#"{"name": "launch", "arguments": {}}"#));
    assert!(!matches(&g, "It is sunny."));
    let g = tool_call(&tools, true).unwrap();
    assert!(matches(&g, "It is sunny.\nIn Paris too: 東京 ✓"));
    assert!(matches(
        &g,
        r#"{"name": "get_time", "arguments": {"zone": "CET"}}"#
    ));
    assert!(!matches(&g, " leading space"));
    assert!(!matches(&g, "{not a call}"));
    let bad = serde_json::from_str::<Json>(r#"{"type": "string", "format": "date"}"#).unwrap();
    let e = tool_call(&[("f", &bad)], false).unwrap_err();
    assert!(
        e.to_string().contains("tools[0].function.parameters#"),
        "{e}"
    );
}
