package pgsql

import "strings"

// TxControl returns the first statement of sql that would end, restart or prepare the
// transaction it runs in — COMMIT, END, ROLLBACK (but not ROLLBACK TO a savepoint), ABORT,
// BEGIN, START TRANSACTION, PREPARE TRANSACTION, with their options (AND CHAIN, WORK,
// PREPARED) — named by its leading keywords in upper case; "" when there is none. Savepoints
// (SAVEPOINT, RELEASE, ROLLBACK TO) are not transaction control here: they end nothing the
// middleware owns.
//
// sql may hold several statements, as the simple protocol allows. The scanner knows just
// enough of PostgreSQL's lexical rules to find where statements start: white space, -- and
// nested /* */ comments, quoted strings, quoted identifiers, dollar quoting and SQL-standard
// function bodies (BEGIN ATOMIC ... END). Whether a backslash escapes a quote in a plain
// string depends on standard_conforming_strings, so sql is scanned both ways and a statement
// found either way counts: in doubt, refuse.
func TxControl(sql string) string {
	if strings.IndexByte(sql, ';') < 0 { // one statement: its first words decide
		return txControlKeywords((&sqlScanner{src: sql}).leadingWords(4))
	}
	if stmt := scanTxControl(sql, false); stmt != "" {
		return stmt
	}
	return scanTxControl(sql, true)
}

// scanTxControl is TxControl with one reading of backslashes in plain strings.
func scanTxControl(sql string, backslashEscapes bool) string {
	s := &sqlScanner{src: sql, backslashEscapes: backslashEscapes}
	for {
		if stmt := txControlKeywords(s.leadingWords(4)); stmt != "" {
			return stmt
		}
		if !s.skipStatement() {
			return ""
		}
	}
}

// txControlKeywords decides from a statement's first words (upper case).
func txControlKeywords(w []string) string {
	if len(w) == 0 {
		return ""
	}
	name := func(n int) string { return strings.Join(w[:min(n, len(w))], " ") }
	switch w[0] {
	case "COMMIT", "END", "ABORT", "BEGIN", "START":
		return name(3)
	case "ROLLBACK":
		i := 1
		if i < len(w) && (w[i] == "WORK" || w[i] == "TRANSACTION") {
			i++
		}
		if i < len(w) && w[i] == "TO" {
			return "" // ROLLBACK TO [SAVEPOINT] name
		}
		return name(3)
	case "PREPARE":
		if len(w) > 1 && w[1] == "TRANSACTION" {
			return name(2)
		}
	}
	return ""
}

// sqlScanner walks SQL text statement by statement.
type sqlScanner struct {
	src              string
	pos              int
	backslashEscapes bool
}

func (s *sqlScanner) peek(off int) byte {
	if s.pos+off < len(s.src) {
		return s.src[s.pos+off]
	}
	return 0
}

// skipSpace skips white space and comments.
func (s *sqlScanner) skipSpace() {
	for s.pos < len(s.src) {
		switch c := s.src[s.pos]; {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v':
			s.pos++
		case c == '-' && s.peek(1) == '-':
			if i := strings.IndexByte(s.src[s.pos:], '\n'); i >= 0 {
				s.pos += i + 1
			} else {
				s.pos = len(s.src)
			}
		case c == '/' && s.peek(1) == '*':
			s.skipBlockComment()
		default:
			return
		}
	}
}

// skipBlockComment skips a /* */ comment; they nest in PostgreSQL.
func (s *sqlScanner) skipBlockComment() {
	depth := 0
	for s.pos < len(s.src) {
		switch {
		case s.src[s.pos] == '/' && s.peek(1) == '*':
			depth++
			s.pos += 2
		case s.src[s.pos] == '*' && s.peek(1) == '/':
			depth--
			s.pos += 2
			if depth == 0 {
				return
			}
		default:
			s.pos++
		}
	}
}

func isWordStart(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '_' || c >= 0x80
}

func isWordPart(c byte) bool { return isWordStart(c) || c >= '0' && c <= '9' || c == '$' }

// word reads a keyword or unquoted identifier at pos, or returns "".
func (s *sqlScanner) word() string {
	if s.pos >= len(s.src) || !isWordStart(s.src[s.pos]) {
		return ""
	}
	start := s.pos
	for s.pos < len(s.src) && isWordPart(s.src[s.pos]) {
		s.pos++
	}
	return s.src[start:s.pos]
}

// leadingWords reads up to n keywords at the start of a statement, in upper case. It stops
// at the first token that is not a word and leaves pos there.
func (s *sqlScanner) leadingWords(n int) []string {
	var words []string
	for len(words) < n {
		s.skipSpace()
		start := s.pos
		w := s.word()
		if w == "" || s.peek(0) == '\'' { // E'...': a string, not a word
			s.pos = start
			break
		}
		words = append(words, strings.ToUpper(w))
	}
	return words
}

// skipStatement moves past the rest of the statement and its ';'. It reports whether another
// statement may follow.
func (s *sqlScanner) skipStatement() bool {
	atomic := 0 // depth inside BEGIN ATOMIC ... END, where ';' does not end the statement
	prev := ""  // the previous word, to spot BEGIN ATOMIC
	for s.pos < len(s.src) {
		c := s.src[s.pos]
		switch {
		case c == ';':
			s.pos++
			if atomic == 0 {
				return true
			}
		case c == '-' && s.peek(1) == '-', c == '/' && s.peek(1) == '*':
			s.skipSpace()
		case c == '\'':
			s.skipString(s.backslashEscapes)
		case c == '"':
			s.skipQuoted('"')
		case c == '$' && s.dollarQuote():
		case isWordStart(c):
			w := strings.ToUpper(s.word())
			if w == "E" && s.peek(0) == '\'' {
				s.skipString(true)
				break
			}
			switch {
			case w == "ATOMIC" && prev == "BEGIN":
				atomic++
			case atomic > 0 && w == "CASE":
				atomic++
			case atomic > 0 && w == "END":
				atomic--
			}
			prev = w
		default:
			s.pos++
		}
	}
	return false
}

// skipString skips a '...' string at pos; ” is a quote inside it, and so is \' when
// backslashes escape.
func (s *sqlScanner) skipString(backslashEscapes bool) {
	s.pos++ // the opening quote
	for s.pos < len(s.src) {
		switch s.src[s.pos] {
		case '\\':
			if backslashEscapes {
				s.pos++
			}
		case '\'':
			if s.peek(1) != '\'' {
				s.pos++
				return
			}
			s.pos++
		}
		s.pos++
	}
}

// skipQuoted skips a quoted identifier; a doubled quote is a quote inside it.
func (s *sqlScanner) skipQuoted(q byte) {
	s.pos++
	for s.pos < len(s.src) {
		if s.src[s.pos] == q {
			if s.peek(1) != q {
				s.pos++
				return
			}
			s.pos++
		}
		s.pos++
	}
}

// dollarQuote skips a $tag$...$tag$ string at pos and reports whether there was one ($1 is a
// parameter, not a quote).
func (s *sqlScanner) dollarQuote() bool {
	end := s.pos + 1
	if end < len(s.src) && isWordStart(s.src[end]) {
		for end < len(s.src) && isWordPart(s.src[end]) && s.src[end] != '$' {
			end++
		}
	}
	if end >= len(s.src) || s.src[end] != '$' {
		return false
	}
	tag := s.src[s.pos : end+1]
	if i := strings.Index(s.src[end+1:], tag); i >= 0 {
		s.pos = end + 1 + i + len(tag)
	} else {
		s.pos = len(s.src)
	}
	return true
}
