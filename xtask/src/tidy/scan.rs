//! The Rust scanner behind `cargo xtask tidy`'s length rule. It is no parser: it blanks out
//! comments, string literals (raw strings `r#"…"#` included, which this code base uses for SQL)
//! and character literals, so that the braces left are code's, and then follows those braces
//! from each `fn NAME` to its body's end and from each `mod NAME {` to the module's end.

/// A function item found in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// The line of its `fn` keyword (1-based).
    pub start: usize,
    /// The line of its body's closing brace.
    pub end: usize,
    /// Whether it is test code: inside a `#[cfg(test)]` module or marked `#[test]`,
    /// `#[…::test]` or `#[cfg(test)]` itself.
    pub test: bool,
}

impl Function {
    /// Its length in lines, from the `fn` line to the closing brace.
    pub fn lines(&self) -> usize {
        self.end + 1 - self.start
    }
}

/// What [`scan`] found in one file.
#[derive(Debug, Default)]
pub struct Scanned {
    /// The function items with a body, in the order their bodies end.
    pub functions: Vec<Function>,
    /// Out-of-line modules (`mod NAME;`), with whether they are test code (`#[cfg(test)]`).
    pub modules: Vec<(String, bool)>,
}

/// Who opened a brace.
enum Owner {
    /// A function body (an index into the functions found so far).
    Function(usize),
    /// Anything else (a module, an `impl`, a block, an expression); `true` when it is test
    /// code by its own attributes (`#[cfg(test)] mod tests {`, `#[cfg(test)] impl …`).
    Block(bool),
}

/// An item keyword seen, waiting for its body's `{` or its `;`.
enum Pending {
    Function { name: String, line: usize },
    Module { name: String },
}

/// Finds the functions and out-of-line modules of `source`.
pub fn scan(source: &str) -> Scanned {
    let code: Vec<char> = code_only(source).chars().collect();
    let mut scanned = Scanned::default();
    let mut stack: Vec<Owner> = Vec::new();
    let mut pending: Option<Pending> = None;
    // `(`/`[` nesting since the pending item's keyword: `;` in `[u8; 4]` ends nothing.
    let mut nesting = 0usize;
    // The code since the last `;`, `{` or `}`: the next item's attributes and signature.
    let mut prefix = String::new();
    let mut line = 1;
    let mut i = 0;
    while i < code.len() {
        let c = code[i];
        if is_ident_start(c) {
            let word = take_ident(&code, &mut i);
            prefix.push_str(&word);
            if (word == "fn" || word == "mod")
                && let Some(name) = next_ident(&code, i)
            {
                pending = Some(if word == "fn" {
                    Pending::Function { name, line }
                } else {
                    Pending::Module { name }
                });
                nesting = 0;
            }
            continue;
        }
        match c {
            '\n' => line += 1,
            '(' | '[' => nesting += 1,
            ')' | ']' => nesting = nesting.saturating_sub(1),
            '{' if nesting == 0 || pending.is_none() => {
                let owner = match pending.take() {
                    Some(Pending::Function { name, line: start }) => {
                        scanned.functions.push(Function {
                            name,
                            start,
                            end: start,
                            test: in_test(&stack, &scanned.functions) || marks_test(&prefix),
                        });
                        Owner::Function(scanned.functions.len() - 1)
                    }
                    Some(Pending::Module { .. }) | None => Owner::Block(marks_cfg_test(&prefix)),
                };
                stack.push(owner);
                prefix.clear();
            }
            '}' if nesting == 0 || pending.is_none() => {
                if let Some(Owner::Function(index)) = stack.pop() {
                    scanned.functions[index].end = line;
                }
                pending = None;
                prefix.clear();
            }
            ';' if nesting == 0 || pending.is_none() => {
                if let Some(Pending::Module { name }) = pending.take() {
                    let test = in_test(&stack, &scanned.functions) || marks_cfg_test(&prefix);
                    scanned.modules.push((name, test));
                }
                pending = None;
                prefix.clear();
            }
            _ => {}
        }
        if !c.is_whitespace() {
            prefix.push(c);
        }
        i += 1;
    }
    scanned
}

/// Whether the braces open around this point belong to test code.
fn in_test(stack: &[Owner], functions: &[Function]) -> bool {
    stack.iter().any(|owner| match owner {
        Owner::Block(test) => *test,
        Owner::Function(index) => functions[*index].test,
    })
}

/// Whether an item's prefix (attributes and signature, whitespace removed) carries
/// `#[cfg(test)]`.
fn marks_cfg_test(prefix: &str) -> bool {
    prefix.contains("#[cfg(test)]")
}

/// Whether a function's prefix marks it as a test or test-only helper.
fn marks_test(prefix: &str) -> bool {
    marks_cfg_test(prefix)
        || prefix.contains("#[test]")
        || prefix.contains("::test]")
        || prefix.contains("::test(")
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The identifier at `*i` (advancing past it).
fn take_ident(code: &[char], i: &mut usize) -> String {
    let start = *i;
    while *i < code.len() && is_ident(code[*i]) {
        *i += 1;
    }
    code[start..*i].iter().collect()
}

/// The identifier after the whitespace at `i`, if one follows (`fn name`, not `fn(`).
fn next_ident(code: &[char], mut i: usize) -> Option<String> {
    while i < code.len() && code[i].is_whitespace() {
        i += 1;
    }
    if i < code.len() && is_ident_start(code[i]) {
        let name = take_ident(code, &mut i);
        // `r#name` is a raw identifier.
        if name == "r" && code.get(i) == Some(&'#') {
            i += 1;
            return Some(take_ident(code, &mut i));
        }
        return Some(name);
    }
    None
}

/// `source` with the insides of comments, string literals and character literals replaced by
/// spaces; line breaks are kept, so line numbers still hold.
pub fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            i = blank_until(&chars, i, &mut out, |chars, j| chars[j] == '\n');
        } else if c == '/' && next == Some('*') {
            i = blank_block_comment(&chars, i, &mut out);
        } else if c == '"' {
            i = blank_string(&chars, i, None, &mut out);
        } else if c == '\'' {
            i = blank_char(&chars, i, &mut out);
        } else if is_ident_start(c) && (i == 0 || !is_ident(chars[i - 1])) {
            i = literal_prefix(&chars, i, &mut out);
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// At an identifier: a raw string (`r"`, `r#"`, `br#"`, `cr"`), a byte or C string (`b"`,
/// `c"`), a byte (`b'x'`), or a plain identifier, copied.
fn literal_prefix(chars: &[char], start: usize, out: &mut String) -> usize {
    let mut i = start;
    if matches!(chars[i], 'b' | 'c') && chars.get(i + 1) == Some(&'r') {
        i += 1;
    }
    if chars[i] == 'r' {
        let mut hashes = 0;
        while chars.get(i + 1 + hashes) == Some(&'#') {
            hashes += 1;
        }
        if chars.get(i + 1 + hashes) == Some(&'"') {
            out.extend(&chars[start..i + 1 + hashes]);
            return blank_string(chars, i + 1 + hashes, Some(hashes), out);
        }
    } else if matches!(chars[i], 'b' | 'c') {
        match chars.get(i + 1) {
            Some('"') => {
                out.push(chars[i]);
                return blank_string(chars, i + 1, None, out);
            }
            Some('\'') if chars[i] == 'b' => {
                out.push('b');
                return blank_char(chars, i + 1, out);
            }
            _ => {}
        }
    }
    let mut end = start;
    while end < chars.len() && is_ident(chars[end]) {
        end += 1;
    }
    out.extend(&chars[start..end]);
    end
}

/// Pushes a space for each character from `i` (a line break for a line break) until `stop`
/// holds at a character, which is left for the caller; returns that character's index.
fn blank_until(
    chars: &[char],
    mut i: usize,
    out: &mut String,
    stop: impl Fn(&[char], usize) -> bool,
) -> usize {
    while i < chars.len() && !stop(chars, i) {
        blank(chars[i], out);
        i += 1;
    }
    i
}

fn blank(c: char, out: &mut String) {
    out.push(if c == '\n' { '\n' } else { ' ' });
}

/// A block comment from its `/*`, nested ones included.
fn blank_block_comment(chars: &[char], mut i: usize, out: &mut String) -> usize {
    let mut depth = 0usize;
    while i < chars.len() {
        let pair = (chars[i], chars.get(i + 1).copied());
        if pair == ('/', Some('*')) {
            depth += 1;
        } else if pair == ('*', Some('/')) {
            depth -= 1;
        } else {
            blank(chars[i], out);
            i += 1;
            continue;
        }
        out.push_str("  ");
        i += 2;
        if depth == 0 {
            break;
        }
    }
    i
}

/// A string from its opening quote at `i`; `raw` is a raw string's count of `#` (escapes do
/// not apply in a raw string). The quotes and hashes are kept, the contents blanked.
fn blank_string(chars: &[char], i: usize, raw: Option<usize>, out: &mut String) -> usize {
    out.push('"');
    let hashes = raw.unwrap_or(0);
    let mut j = i + 1;
    while j < chars.len() {
        let c = chars[j];
        if c == '\\' && raw.is_none() {
            blank(c, out);
            if let Some(&escaped) = chars.get(j + 1) {
                blank(escaped, out);
            }
            j += 2;
            continue;
        }
        if c == '"' && (0..hashes).all(|k| chars.get(j + 1 + k) == Some(&'#')) {
            out.push('"');
            out.extend(std::iter::repeat_n('#', hashes));
            return j + 1 + hashes;
        }
        blank(c, out);
        j += 1;
    }
    j
}

/// At a `'`: a character literal (`'x'`, `'\n'`, `'\u{7b}'`), blanked, or a lifetime or label,
/// copied.
fn blank_char(chars: &[char], i: usize, out: &mut String) -> usize {
    out.push('\'');
    let literal_end = match (chars.get(i + 1), chars.get(i + 2)) {
        // The escaped character is at i + 2 (`'\''` too); the closing quote comes after it.
        (Some('\\'), _) => chars
            .get(i + 3..)
            .and_then(|rest| rest.iter().position(|&c| c == '\''))
            .map(|p| i + 3 + p),
        (Some(_), Some('\'')) => Some(i + 2),
        _ => None,
    };
    let Some(end) = literal_end else {
        return i + 1;
    };
    for &c in &chars[i + 1..end] {
        blank(c, out);
    }
    out.push('\'');
    end + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names_and_lengths(source: &str) -> Vec<(String, usize, bool)> {
        let mut functions = scan(source).functions;
        functions.sort_by_key(|f| f.start);
        functions
            .into_iter()
            .map(|f| (f.name.clone(), f.lines(), f.test))
            .collect()
    }

    #[test]
    fn braces_in_strings_comments_and_characters_are_not_code() {
        let source = r####"
fn sql() -> &'static str {
    // a comment with a brace {
    /* a block { /* nested } */ still a comment { */
    let _open = '{';
    let _quote = '\'';
    let _escaped = '\u{7b}';
    let _quote = "a \" and a { brace";
    r#"SELECT '{' FROM t WHERE x = "}" "#
}

fn after() {}
"####;
        assert_eq!(
            names_and_lengths(source),
            vec![("sql".into(), 9, false), ("after".into(), 1, false)]
        );
    }

    #[test]
    fn raw_strings_with_hashes_and_quotes_end_at_their_own_delimiter() {
        let source = "fn q() {\n    let _s = r##\"a \"# } { \"## ;\n    let _b = br#\"}\"#;\n}\n";
        assert_eq!(names_and_lengths(source), vec![("q".into(), 4, false)]);
    }

    #[test]
    fn lifetimes_are_not_character_literals() {
        let source = "fn f<'a>(x: &'a str) -> &'a str {\n    x\n}\nfn g() {}\n";
        assert_eq!(
            names_and_lengths(source),
            vec![("f".into(), 3, false), ("g".into(), 1, false)]
        );
    }

    #[test]
    fn signatures_with_arrays_and_declarations_without_bodies() {
        let source = "trait T {\n    fn decl(&self, x: [u8; 4]);\n}\nfn body(x: [u8; 4]) -> u8 {\n    x[0]\n}\ntype F = fn(u8) -> u8;\n";
        assert_eq!(names_and_lengths(source), vec![("body".into(), 3, false)]);
    }

    #[test]
    fn test_modules_and_test_functions_are_test_code() {
        let source = "fn code() {}\n#[cfg(test)]\nmod tests {\n    fn helper() {}\n    #[test]\n    fn case() {}\n}\n#[test]\nfn loose() {}\n#[cfg(test)]\nmod more;\nmod other;\n";
        assert_eq!(
            names_and_lengths(source),
            vec![
                ("code".into(), 1, false),
                ("helper".into(), 1, true),
                ("case".into(), 1, true),
                ("loose".into(), 1, true),
            ]
        );
        assert_eq!(
            scan(source).modules,
            vec![("more".into(), true), ("other".into(), false)]
        );
    }

    #[test]
    fn code_only_keeps_lines_and_code() {
        let source = "let a = \"x\ny\"; // c\nlet b = 1;";
        assert_eq!(code_only(source), "let a = \" \n \";     \nlet b = 1;");
    }
}
