//! The OpenAPI document against the code: the committed `docs/openapi.json`
//! is exactly what the server builds, every route the router serves is in
//! it (and nothing else), every reference resolves, and it is served at
//! `GET /v1/openapi.json` without a token.
//!
//! After changing a route or a wire type, regenerate the file with
//! `RUNBOX_UPDATE_OPENAPI=1 cargo test -p runbox-server --test openapi`.

use std::collections::BTreeSet;
use std::path::PathBuf;

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json")
}

#[test]
fn the_committed_document_is_what_the_server_builds() {
    let built = runbox_server::openapi::document_json();
    let path = committed_path();
    if std::env::var_os("RUNBOX_UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &built).expect("writing docs/openapi.json");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == built,
        "docs/openapi.json differs from the code; regenerate it with \
         `RUNBOX_UPDATE_OPENAPI=1 cargo test -p runbox-server --test openapi` and review the diff"
    );
}

/// (method, path) of every route in the router's source.
fn routes_in_source() -> BTreeSet<(String, String)> {
    let source = include_str!("../src/lib.rs");
    let mut routes = BTreeSet::new();
    let mut rest = source;
    while let Some(at) = rest.find(".route(") {
        rest = &rest[at + ".route(".len()..];
        let Some(open) = rest.find('"') else { break };
        let after = &rest[open + 1..];
        let close = after.find('"').expect("a closing quote");
        let path = after[..close].replace("{*path}", "{path}");
        // The handlers of this route: everything up to the next `.route(`
        // or the end of the chain.
        let body = &after[close..];
        let end = body.find(".route(").unwrap_or(body.len());
        let chain = &body[..end];
        for method in ["get", "post", "put", "patch", "delete"] {
            let direct = format!("{method}(");
            let chained = format!(".{method}(");
            let found = chain.match_indices(&direct).any(|(i, _)| {
                i == 0
                    || !chain[..i]
                        .chars()
                        .last()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_')
            }) || chain.contains(&chained);
            if found {
                routes.insert((method.to_owned(), path.clone()));
            }
        }
    }
    routes
}

#[test]
fn every_route_is_documented_and_nothing_else() {
    let document = runbox_server::openapi::document();
    let value = serde_json::to_value(&document).unwrap();
    let mut documented = BTreeSet::new();
    for (path, item) in value["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            documented.insert((method.clone(), path.clone()));
        }
    }
    let served = routes_in_source();
    assert!(served.len() > 40, "the route parser found only {served:?}");
    let undocumented: Vec<_> = served.difference(&documented).collect();
    let unserved: Vec<_> = documented.difference(&served).collect();
    assert!(
        undocumented.is_empty() && unserved.is_empty(),
        "routes not in the document: {undocumented:?}; documented but not served: {unserved:?}"
    );
}

#[test]
fn every_reference_resolves_and_every_operation_has_an_id() {
    let value = serde_json::to_value(runbox_server::openapi::document()).unwrap();
    let schemas = value["components"]["schemas"].as_object().unwrap();
    let mut refs = Vec::new();
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(map) => {
                if let Some(serde_json::Value::String(r)) = map.get("$ref") {
                    out.push(r.clone());
                }
                map.values().for_each(|v| walk(v, out));
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&value, &mut refs);
    assert!(!refs.is_empty());
    for r in refs {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("unexpected reference {r}"));
        assert!(schemas.contains_key(name), "{r} does not resolve");
    }
    let mut ids = BTreeSet::new();
    for item in value["paths"].as_object().unwrap().values() {
        for op in item.as_object().unwrap().values() {
            let id = op["operationId"].as_str().expect("an operationId");
            assert!(ids.insert(id.to_owned()), "operationId {id} twice");
        }
    }
    assert_eq!(value["openapi"], "3.1.0");
}

/// docs/api.md's contents list every numbered section, in order, with
/// the anchor its heading gets.
#[test]
fn the_api_docs_contents_match_their_sections() {
    let doc = include_str!("../../../docs/api.md");
    let headings: Vec<&str> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .filter(|h| h.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .collect();
    let anchor = |heading: &str| {
        heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect::<String>()
    };
    let contents: Vec<(String, String)> = doc
        .split("Contents:")
        .nth(1)
        .expect("a contents list")
        .lines()
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| !l.trim().is_empty())
        .map(|l| {
            let title = l
                .split('[')
                .nth(1)
                .and_then(|r| r.split(']').next())
                .unwrap();
            let link = l
                .split("](#")
                .nth(1)
                .and_then(|r| r.split(')').next())
                .unwrap();
            (title.to_owned(), link.to_owned())
        })
        .collect();
    assert_eq!(
        contents.len(),
        headings.len(),
        "{contents:?} vs {headings:?}"
    );
    for ((title, link), heading) in contents.iter().zip(&headings) {
        assert!(
            heading.ends_with(title.as_str()),
            "{title:?} vs {heading:?}"
        );
        assert_eq!(*link, anchor(heading), "{heading:?}");
    }
}
