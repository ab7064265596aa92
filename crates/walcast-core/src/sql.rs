//! Identifier quoting and parsing. Values never go through here: they are always bound
//! as parameters.

/// Quote an identifier the way Postgres's `quote_ident` would if it always quoted:
/// wrap in double quotes and double every embedded double quote.
pub fn quote_ident(ident: &str) -> String {
    let mut out = String::with_capacity(ident.len() + 2);
    out.push('"');
    for c in ident.chars() {
        if c == '"' {
            out.push('"');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `schema.table`, both quoted.
pub fn qualified(schema: &str, table: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(table))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NameError {
    #[error("empty name")]
    Empty,
    #[error("unterminated quoted identifier in {0:?}")]
    Unterminated(String),
    #[error("expected `schema.table` or `table`, got {0:?}")]
    Shape(String),
    #[error("a zero-length identifier is not allowed in {0:?}")]
    ZeroLength(String),
}

/// Parse `table`, `schema.table`, with SQL rules: unquoted parts fold to lower case, quoted
/// parts (`"My Table"`, `"a""b"`) are taken as written. A missing schema is `public`.
pub fn parse_qualified_name(input: &str) -> Result<(String, String), NameError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(NameError::Empty);
    }
    let mut parts = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        let mut part = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        part.push('"');
                    }
                    Some('"') => break,
                    Some(c) => part.push(c),
                    None => return Err(NameError::Unterminated(input.to_string())),
                }
            }
            if part.is_empty() {
                return Err(NameError::ZeroLength(input.to_string()));
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == '.' {
                    break;
                }
                if c == '"' || c.is_whitespace() {
                    return Err(NameError::Shape(input.to_string()));
                }
                part.extend(c.to_lowercase());
                chars.next();
            }
            if part.is_empty() {
                return Err(NameError::Shape(input.to_string()));
            }
        }
        parts.push(part);
        match chars.next() {
            None => break,
            Some('.') => continue,
            Some(_) => return Err(NameError::Shape(input.to_string())),
        }
    }
    match parts.len() {
        1 => Ok(("public".to_string(), parts.remove(0))),
        2 => {
            let table = parts.remove(1);
            Ok((parts.remove(0), table))
        }
        _ => Err(NameError::Shape(input.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn quoting() {
        assert_eq!(quote_ident("todos"), "\"todos\"");
        assert_eq!(
            quote_ident("a\"; drop table x; --"),
            "\"a\"\"; drop table x; --\""
        );
        assert_eq!(qualified("My Schema", "t.x"), "\"My Schema\".\"t.x\"");
    }

    #[test]
    fn parsing() {
        assert_eq!(
            parse_qualified_name("Todos").unwrap(),
            ("public".into(), "todos".into())
        );
        assert_eq!(
            parse_qualified_name("app.\"My.Table\"").unwrap(),
            ("app".into(), "My.Table".into())
        );
        assert_eq!(
            parse_qualified_name("\"a\"\"b\".c").unwrap(),
            ("a\"b".into(), "c".into())
        );
        assert!(parse_qualified_name("a.b.c").is_err());
        assert!(parse_qualified_name("\"open").is_err());
        assert!(parse_qualified_name("a b").is_err());
        assert!(parse_qualified_name("").is_err());
        assert!(parse_qualified_name("\"\"").is_err());
    }

    proptest! {
        #[test]
        fn quoted_names_parse_back(schema in "\\PC+", table in "\\PC+") {
            let text = qualified(&schema, &table);
            prop_assert_eq!(parse_qualified_name(&text), Ok((schema, table)));
        }

        #[test]
        fn parsing_never_panics(s in "\\PC*") {
            let _ = parse_qualified_name(&s);
        }
    }
}
