//! Building wal2json's `add-tables` option value.
//!
//! wal2json 2.5 parses `add-tables` in two steps (verified against the real
//! plugin, see `fixtures/08_add_tables.sql`):
//!
//! 1. The value is split into entries on unescaped `,`. An unescaped white-space
//!    byte (C `isspace`: space, `\t`, `\n`, `\v`, `\f`, `\r`) ends an entry and
//!    may only be followed by more white space and a `,` (or the end), so white
//!    space inside a name must be escaped. A `\` makes the next byte literal.
//!    Empty entries (`a.b,` or `,a.b`) make the whole option invalid.
//! 2. Each entry is split on its first unescaped `.` into schema and table, then
//!    every `\` is removed, keeping the byte after it. An entry without a `.` is
//!    invalid. Names are compared byte-for-byte (case-sensitive, no quoting).
//!    An entry that starts with `*.` (unescaped) matches every schema, and a
//!    table part that is exactly `*` (unescaped) matches every table; `\*`, or a
//!    `*` anywhere else, is a literal asterisk.
//!
//! An empty value selects *no* table at all (though wal2json still sends a B/C
//! pair for every transaction); leave the option out to get every table.

/// Builds an `add-tables` value that selects exactly the given `(schema, table)`
/// pairs (unquoted names, as stored in `pg_class`/`pg_namespace`).
///
/// Escapes `\`, `,`, `.`, `*` and ASCII white space in every name with a
/// backslash; nothing else needs escaping (non-ASCII is passed through).
/// Names must not contain NUL (Postgres does not allow it anyway). An empty
/// iterator gives `""`, which makes wal2json select no table.
///
/// The result still has to be quoted for wherever it is used: as a SQL literal
/// for `pg_logical_slot_get_changes`, or in `START_REPLICATION ... ("add-tables"
/// 'value')`.
pub fn add_tables_option<'a>(tables: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::new();
    for (i, (schema, table)) in tables.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_escaped(&mut out, schema);
        out.push('.');
        push_escaped(&mut out, table);
    }
    out
}

/// [`add_tables_option`] plus every table of each of `schemas` (`schema.*`: tables
/// created later included).
pub fn add_tables_and_schemas<'a>(
    tables: impl IntoIterator<Item = (&'a str, &'a str)>,
    schemas: impl IntoIterator<Item = &'a str>,
) -> String {
    let mut out = add_tables_option(tables);
    for schema in schemas {
        if !out.is_empty() {
            out.push(',');
        }
        push_escaped(&mut out, schema);
        out.push_str(".*");
    }
    out
}

/// Whether C's `isspace` (as wal2json calls it on each byte) is true: ASCII white
/// space including vertical tab. Bytes of multi-byte UTF-8 sequences never are.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r')
}

fn push_escaped(out: &mut String, name: &str) {
    for c in name.chars() {
        if matches!(c, '\\' | ',' | '.' | '*') || is_c_space(c) {
            out.push('\\');
        }
        out.push(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One parsed `add-tables` entry, as wal2json's `SelectTable`.
    #[derive(Debug, PartialEq, Eq)]
    struct Selector {
        schema: Vec<u8>,
        table: Vec<u8>,
        all_schemas: bool,
        all_tables: bool,
    }

    fn is_space(b: u8) -> bool {
        matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
    }

    /// Reference parser modelled on wal2json 2.5's `string_to_SelectTable` and
    /// `parse_table_identifier` (byte-wise, like the C code). `None` = the
    /// "could not parse value" error.
    fn reference_parse(value: &str) -> Option<Vec<Selector>> {
        let s = value.as_bytes();
        let mut i = 0;
        while i < s.len() && is_space(s[i]) {
            i += 1;
        }
        let mut entries: Vec<&[u8]> = Vec::new();
        if i == s.len() {
            return Some(Vec::new());
        }
        loop {
            let start = i;
            while i < s.len() && s[i] != b',' && !is_space(s[i]) {
                if s[i] == b'\\' {
                    i += 1;
                    if i == s.len() {
                        return None; // wal2json would read past the end
                    }
                }
                i += 1;
            }
            if i == start {
                return None;
            }
            let end = i;
            while i < s.len() && is_space(s[i]) {
                i += 1;
            }
            entries.push(&s[start..end]);
            if i == s.len() {
                break;
            }
            if s[i] != b',' {
                return None;
            }
            i += 1;
            while i < s.len() && is_space(s[i]) {
                i += 1;
            }
        }

        let mut out = Vec::new();
        for entry in entries {
            let all_schemas = entry.starts_with(b"*.");
            let mut schema = Vec::new();
            let mut j = 0;
            while j < entry.len() && entry[j] != b'.' {
                if entry[j] == b'\\' {
                    j += 1;
                }
                schema.push(*entry.get(j)?);
                j += 1;
            }
            if j == entry.len() {
                return None; // no separator
            }
            let rest = &entry[j + 1..];
            let all_tables = rest == b"*";
            let mut table = Vec::new();
            let mut k = 0;
            while k < rest.len() {
                if rest[k] == b'\\' {
                    k += 1;
                }
                table.push(*rest.get(k)?);
                k += 1;
            }
            out.push(Selector {
                schema,
                table,
                all_schemas,
                all_tables,
            });
        }
        Some(out)
    }

    fn exact(schema: &str, table: &str) -> Selector {
        Selector {
            schema: schema.as_bytes().to_vec(),
            table: table.as_bytes().to_vec(),
            all_schemas: false,
            all_tables: false,
        }
    }

    #[test]
    fn escapes_special_characters() {
        assert_eq!(add_tables_option([("public", "t")]), "public.t");
        assert_eq!(
            add_tables_option([("Mixed Case", "Tab,1"), ("dot.s", "a.b")]),
            r"Mixed\ Case.Tab\,1,dot\.s.a\.b"
        );
        assert_eq!(add_tables_option([("*", "*")]), r"\*.\*");
        assert_eq!(
            add_tables_option([("public", "back\\slash")]),
            r"public.back\\slash"
        );
        assert_eq!(add_tables_option([("public", "tab\tx")]), "public.tab\\\tx");
        assert_eq!(add_tables_option([("ünï", "☃")]), "ünï.☃");
        assert_eq!(add_tables_option([]), "");
    }

    #[test]
    fn reference_parser_matches_observed_wal2json() {
        // Behaviour observed on PostgreSQL 15 + wal2json 2.5.
        assert_eq!(
            reference_parse(r"Mixed\ Case.Tab\,1"),
            Some(vec![exact("Mixed Case", "Tab,1")])
        );
        assert_eq!(reference_parse(r"Mixed Case.Tab\,1"), None);
        assert_eq!(
            reference_parse(r"dot\.s.a.b"),
            Some(vec![exact("dot.s", "a.b")])
        );
        assert_eq!(reference_parse("dot.s.a"), Some(vec![exact("dot", "s.a")]));
        assert_eq!(
            reference_parse(r"public.back\slash"),
            Some(vec![exact("public", "backslash")])
        );
        assert_eq!(
            reference_parse(r"public.Star*"),
            Some(vec![exact("public", "Star*")])
        );
        assert_eq!(
            reference_parse(" public.Star ,  public.Star\\* "),
            Some(vec![exact("public", "Star"), exact("public", "Star*")])
        );
        assert_eq!(reference_parse("public.Star,"), None);
        assert_eq!(reference_parse("public"), None);
        assert_eq!(reference_parse(""), Some(vec![]));
        let wild = reference_parse(r"*.\*,\*.*").unwrap();
        assert!(wild[0].all_schemas && !wild[0].all_tables);
        assert!(!wild[1].all_schemas && wild[1].all_tables);
        assert_eq!(wild[0].table, b"*");
        assert_eq!(wild[1].schema, b"*");
    }

    #[test]
    fn whole_schemas_use_the_unescaped_wildcard() {
        let v = add_tables_and_schemas([("public", "*")], ["walcast_outbox_parts", "a.b"]);
        assert_eq!(v, r"public.\*,walcast_outbox_parts.*,a\.b.*");
        let parsed = reference_parse(&v).unwrap();
        assert!(!parsed[0].all_tables && parsed[0].table == b"*");
        assert!(parsed[1].all_tables && parsed[1].schema == b"walcast_outbox_parts");
        assert!(parsed[2].all_tables && parsed[2].schema == b"a.b");
        assert_eq!(add_tables_and_schemas([], ["s"]), "s.*");
    }

    fn name() -> impl Strategy<Value = String> {
        let special = prop::sample::select(vec![
            '\\', ',', '.', '*', ' ', '\t', '\n', '\x0B', '\x0C', '\r', '"', '\'', 'A', 'z', '0',
            '_', 'é', '☃', '😀', '\u{a0}', '\u{85}',
        ]);
        let c = prop_oneof![3 => special, 1 => any::<char>().prop_filter("no NUL", |c| *c != '\0')];
        prop::collection::vec(c, 1..12).prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        #[test]
        fn option_selects_exactly_the_given_tables(
            tables in prop::collection::vec((name(), name()), 1..5)
        ) {
            let value = add_tables_option(tables.iter().map(|(s, t)| (s.as_str(), t.as_str())));
            let parsed = reference_parse(&value);
            let expected: Vec<Selector> = tables.iter().map(|(s, t)| exact(s, t)).collect();
            prop_assert_eq!(parsed, Some(expected), "value: {:?}", value);
        }
    }
}
