// Package docscheck keeps the Go code in README.md and docs/*.md compiling: its test extracts
// every ```go block, turns each into a Go file of a package per Markdown file, and compiles
// them with `go build -overlay` (nothing is written into the source tree). Compiler errors
// point at the Markdown line (//line directives).
//
// A block is compiled as it stands when it is a list of declarations (types, funcs, vars),
// or as the body of a function when it is a list of statements. A block may start with an
// import declaration; other imports are added for the package names it uses (Imports). A
// statement block may use the names in Ambient without declaring them (ctx, pool, tx, ...);
// the variables it declares need not be used. Blocks of one Markdown file share a package,
// so a later block may use what an earlier one declared. A block that cannot compile (a
// sketch with a dependency onceflow does not have) is preceded by a line
// <!-- docscheck:skip reason -->. See CONTRIBUTING.md, "Code in the documentation".
package docscheck

import (
	"bufio"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Block is one ```go block of a Markdown file.
type Block struct {
	// File is the Markdown file's path, as given to Blocks.
	File string
	// Line is the line number of the block's first line of code (after the fence).
	Line int
	// Code is the block's text, with the fence's indentation removed.
	Code string
	// Skip is the reason given by a <!-- docscheck:skip reason --> line just before the
	// fence, or "" when the block is checked.
	Skip string
	// QuoteFile and QuoteRegion are set by a <!-- docscheck:quote FILE REGION --> line just
	// before the fence: the block is the region of that Go file between the lines
	// "// REGION:begin" and "// REGION:end", which compiles (and runs) where it is. Such a
	// block is not compiled again; the test checks it equals the region.
	QuoteFile, QuoteRegion string
}

var (
	fenceOpen = regexp.MustCompile("^([ \t]*)```go[ \t]*$")
	skipMark  = regexp.MustCompile(`^\s*<!--\s*docscheck:skip\s*(.*?)\s*-->\s*$`)
	quoteMark = regexp.MustCompile(`^\s*<!--\s*docscheck:quote\s+(\S+)\s+(\S+)\s*-->\s*$`)
)

// Blocks returns the ```go blocks of a Markdown text, in order.
func Blocks(file, markdown string) ([]Block, error) {
	var blocks []Block
	sc := bufio.NewScanner(strings.NewReader(markdown))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var (
		cur    *Block
		indent string
		prev   string
		lines  []string
		n      int
	)
	for sc.Scan() {
		n++
		line := sc.Text()
		if cur == nil {
			if m := fenceOpen.FindStringSubmatch(line); m != nil {
				cur = &Block{File: file, Line: n + 1}
				indent = m[1]
				lines = nil
				if s := skipMark.FindStringSubmatch(prev); s != nil {
					cur.Skip = s[1]
					if cur.Skip == "" {
						cur.Skip = "no reason given"
					}
				}
				if q := quoteMark.FindStringSubmatch(prev); q != nil {
					cur.QuoteFile, cur.QuoteRegion = q[1], q[2]
				}
			}
			if strings.TrimSpace(line) != "" {
				prev = line
			}
			continue
		}
		if strings.TrimSpace(line) == "```" {
			cur.Code = strings.Join(lines, "\n") + "\n"
			blocks = append(blocks, *cur)
			cur = nil
			prev = line
			continue
		}
		lines = append(lines, strings.TrimPrefix(line, indent))
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if cur != nil {
		return nil, fmt.Errorf("%s:%d: ```go block is not closed", file, cur.Line-1)
	}
	return blocks, nil
}

// Imports maps the package names documentation may use without importing them to their
// import paths.
var Imports = map[string]string{
	"bytes": "bytes", "context": "context", "errors": "errors", "fmt": "fmt", "io": "io", "log": "log",
	"os": "os", "strings": "strings", "sync": "sync", "time": "time", "testing": "testing",
	"http": "net/http", "httptest": "net/http/httptest", "slog": "log/slog",
	"json": "encoding/json", "signal": "os/signal", "syscall": "syscall",

	"pgx": "github.com/jackc/pgx/v5", "pgxpool": "github.com/jackc/pgx/v5/pgxpool",
	"pgconn":     "github.com/jackc/pgx/v5/pgconn",
	"watermill":  "github.com/ThreeDotsLabs/watermill",
	"message":    "github.com/ThreeDotsLabs/watermill/message",
	"middleware": "github.com/ThreeDotsLabs/watermill/message/router/middleware",
	"cqrs":       "github.com/ThreeDotsLabs/watermill/components/cqrs",
	"gochannel":  "github.com/ThreeDotsLabs/watermill/pubsub/gochannel",
	"kafka":      "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka",
	"sarama":     "github.com/IBM/sarama",
	"kgo":        "github.com/twmb/franz-go/pkg/kgo",
	"kfake":      "github.com/twmb/franz-go/pkg/kfake",
	"redis":      "github.com/redis/go-redis/v9",
	"prometheus": "github.com/prometheus/client_golang/prometheus",
	"promhttp":   "github.com/prometheus/client_golang/prometheus/promhttp",

	"outbox":          "github.com/onceflow/onceflow/outbox",
	"inbox":           "github.com/onceflow/onceflow/inbox",
	"inboxkafka":      "github.com/onceflow/onceflow/inbox/inboxkafka",
	"inboxprom":       "github.com/onceflow/onceflow/inbox/inboxprom",
	"redisdedup":      "github.com/onceflow/onceflow/inbox/redisdedup",
	"relay":           "github.com/onceflow/onceflow/relay",
	"relaykafka":      "github.com/onceflow/onceflow/relay/relaykafka",
	"relayprom":       "github.com/onceflow/onceflow/relay/relayprom",
	"saga":            "github.com/onceflow/onceflow/saga",
	"sagatest":        "github.com/onceflow/onceflow/saga/sagatest",
	"sagaprom":        "github.com/onceflow/onceflow/saga/sagaprom",
	"idempotency":     "github.com/onceflow/onceflow/idempotency",
	"idempotencyprom": "github.com/onceflow/onceflow/idempotency/idempotencyprom",
	"retention":       "github.com/onceflow/onceflow/retention",
	"migrations":      "github.com/onceflow/onceflow/migrations",
	"onceflowtest":    "github.com/onceflow/onceflow/onceflowtest",
	"console":         "github.com/onceflow/onceflow/console",
}

// Ambient maps the names a statement block may use without declaring them to their types:
// what the surrounding code of a service would have at hand.
var Ambient = map[string]string{
	"ctx":     "context.Context",
	"pool":    "*pgxpool.Pool",
	"tx":      "pgx.Tx",
	"brokers": "[]string",
	"logger":  "watermill.LoggerAdapter",
	"router":  "*message.Router",
	"sub":     "message.Subscriber",
	"msg":     "*message.Message",
	"mux":     "*http.ServeMux",
	"w":       "http.ResponseWriter",
	"r":       "*http.Request",
	"rdb":     "*redis.Client",
	"ib":      "*inbox.Inbox",
	"pub":     "message.Publisher",
	"orch":    "*saga.Orchestrator",
	"t":       "*testing.T",
}

// File is a generated Go file for one block.
type File struct {
	Block Block
	// Name is the file's base name, e.g. "block_03.go".
	Name string
	// Source is the Go source.
	Source string
}

// Package turns the checked blocks of one Markdown file into the files of one Go package
// named pkg. It reports blocks that parse neither as declarations nor as statements.
func Package(pkg string, blocks []Block) ([]File, error) {
	type parsed struct {
		b        Block
		imports  []importSpec
		body     string // the block without its import declaration
		bodyLine int    // Markdown line of body's first line
		decls    bool
		file     *ast.File
	}
	var all []parsed
	declared := map[string]bool{} // package-level names the blocks declare
	var errs []string
	for _, b := range blocks {
		if b.Skip != "" || b.QuoteFile != "" {
			continue
		}
		imps, body, skipped, err := splitImports(b.Code)
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s:%d: import declaration: %v", b.File, b.Line, err))
			continue
		}
		p := parsed{b: b, imports: imps, body: body, bodyLine: b.Line + skipped}
		fset := token.NewFileSet()
		// The //line directive makes parse errors name the Markdown line.
		at := fmt.Sprintf("//line %s:%d\n", b.File, p.bodyLine)
		if f, err := parser.ParseFile(fset, "", "package p\n"+at+body, 0); err == nil && len(f.Decls) > 0 {
			p.decls, p.file = true, f
			for _, d := range f.Decls {
				for _, name := range declNames(d) {
					declared[name] = true
				}
			}
		} else if f, err2 := parser.ParseFile(fset, "", "package p\nfunc _() error {\n"+at+body+"\n}\n", 0); err2 == nil {
			p.file = f
		} else {
			errs = append(errs, fmt.Sprintf("%s:%d: the block is neither Go declarations nor Go statements:\n  as declarations: %v\n  as statements: %v", b.File, b.Line, err, err2))
			continue
		}
		all = append(all, p)
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("%s", strings.Join(errs, "\n"))
	}
	var files []File
	for i, p := range all {
		unresolved := map[string]bool{}
		for _, id := range p.file.Unresolved {
			if !declared[id.Name] {
				unresolved[id.Name] = true
			}
		}
		// Imports: the block's own, then those of the package names it uses.
		imports := map[string]string{} // name → path
		for _, s := range p.imports {
			imports[s.name] = s.path
		}
		var params []string
		if !p.decls {
			for _, name := range sortedKeys(unresolved) {
				if typ, ok := Ambient[name]; ok {
					params = append(params, name+" "+typ)
					for pkgName := range unresolvedPackages(typ) {
						unresolved[pkgName] = true
					}
				}
			}
		}
		for name := range unresolved {
			if _, ok := imports[name]; ok {
				continue
			}
			if path, ok := Imports[name]; ok {
				imports[name] = path
			}
		}
		var src strings.Builder
		fmt.Fprintf(&src, "package %s\n\n", pkg)
		if len(imports) > 0 {
			src.WriteString("import (\n")
			for _, name := range sortedKeys(imports) {
				fmt.Fprintf(&src, "\t%s %q\n", name, imports[name]) // named: the name the block uses
			}
			src.WriteString(")\n\n")
		}
		if p.decls {
			fmt.Fprintf(&src, "//line %s:%d\n%s", p.b.File, p.bodyLine, p.body)
		} else {
			// A function returning error, so the block may `return err`.
			fmt.Fprintf(&src, "func _(%s) error {\n\t{\n//line %s:%d\n%s", strings.Join(params, ", "), p.b.File, p.bodyLine, p.body)
			// The variables a block declares at its top level need not be used: it shows a call.
			for _, name := range topLevelVars(p.file) {
				fmt.Fprintf(&src, "\t_ = %s\n", name)
			}
			src.WriteString("\t}\n\treturn nil\n}\n")
		}
		files = append(files, File{Block: p.b, Name: fmt.Sprintf("block_%02d.go", i+1), Source: src.String()})
	}
	return files, nil
}

// Region returns the lines of a Go source between "// name:begin" and "// name:end",
// without the marker lines and without blank lines at either end.
func Region(src, name string) (string, error) {
	begin, end := "// "+name+":begin", "// "+name+":end"
	lines := strings.Split(src, "\n")
	from, to := -1, -1
	for i, l := range lines {
		switch strings.TrimSpace(l) {
		case begin:
			from = i + 1
		case end:
			to = i
		}
	}
	if from < 0 || to < from {
		return "", fmt.Errorf("no region %q (lines %q and %q)", name, begin, end)
	}
	region := strings.Trim(strings.Join(lines[from:to], "\n"), "\n")
	return region + "\n", nil
}

// PackageName returns a Go package name for a Markdown file: "README.md" → "doc_readme".
func PackageName(file string) string {
	base := strings.ToLower(strings.TrimSuffix(path.Base(file), path.Ext(file)))
	var b strings.Builder
	b.WriteString("doc_")
	for _, r := range base {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
		} else {
			b.WriteRune('_')
		}
	}
	return b.String()
}

type importSpec struct{ name, path string }

// splitImports cuts a leading import declaration off code and returns its specs, the rest of
// the code and the number of lines cut.
func splitImports(code string) (specs []importSpec, rest string, lines int, err error) {
	trimmed := strings.TrimLeft(code, "\n")
	lines = strings.Count(code[:len(code)-len(trimmed)], "\n")
	if !strings.HasPrefix(trimmed, "import") {
		return nil, code, 0, nil
	}
	fset := token.NewFileSet()
	// Parse the longest prefix that is a file of imports only.
	all := strings.SplitAfter(trimmed, "\n")
	end := 0
	var f *ast.File
	for i := 1; i <= len(all); i++ {
		prefix := strings.Join(all[:i], "")
		g, perr := parser.ParseFile(fset, "", "package p\n"+prefix, parser.ImportsOnly)
		if perr == nil && len(g.Decls) > 0 && onlyImports(g) {
			f, end = g, i
			if strings.HasPrefix(strings.TrimSpace(all[0]), "import (") && strings.TrimSpace(all[i-1]) != ")" {
				continue
			}
			break
		}
	}
	if f == nil {
		return nil, "", 0, fmt.Errorf("cannot parse it")
	}
	for _, s := range f.Imports {
		p, _ := strconv.Unquote(s.Path.Value)
		name := path.Base(p)
		if len(name) > 1 && name[0] == 'v' && name[1] >= '0' && name[1] <= '9' {
			name = path.Base(path.Dir(p)) // github.com/jackc/pgx/v5 → pgx
		}
		if s.Name != nil {
			name = s.Name.Name
		}
		specs = append(specs, importSpec{name: name, path: p})
	}
	return specs, strings.Join(all[end:], ""), lines + end, nil
}

func onlyImports(f *ast.File) bool {
	for _, d := range f.Decls {
		if g, ok := d.(*ast.GenDecl); !ok || g.Tok != token.IMPORT {
			return false
		}
	}
	return true
}

func declNames(d ast.Decl) []string {
	switch d := d.(type) {
	case *ast.FuncDecl:
		if d.Recv == nil {
			return []string{d.Name.Name}
		}
	case *ast.GenDecl:
		var names []string
		for _, s := range d.Specs {
			switch s := s.(type) {
			case *ast.TypeSpec:
				names = append(names, s.Name.Name)
			case *ast.ValueSpec:
				for _, n := range s.Names {
					names = append(names, n.Name)
				}
			}
		}
		return names
	}
	return nil
}

// topLevelVars returns the variables declared by the statements of the single function in f.
func topLevelVars(f *ast.File) []string {
	seen := map[string]bool{}
	var names []string
	add := func(id *ast.Ident) {
		if id.Name != "_" && !seen[id.Name] {
			seen[id.Name] = true
			names = append(names, id.Name)
		}
	}
	fn := f.Decls[0].(*ast.FuncDecl)
	for _, st := range fn.Body.List {
		switch st := st.(type) {
		case *ast.AssignStmt:
			if st.Tok == token.DEFINE {
				for _, e := range st.Lhs {
					if id, ok := e.(*ast.Ident); ok {
						add(id)
					}
				}
			}
		case *ast.DeclStmt:
			if g, ok := st.Decl.(*ast.GenDecl); ok && g.Tok == token.VAR {
				for _, s := range g.Specs {
					for _, id := range s.(*ast.ValueSpec).Names {
						add(id)
					}
				}
			}
		}
	}
	return names
}

var qualified = regexp.MustCompile(`([a-z][a-z0-9]*)\.`)

func unresolvedPackages(typ string) map[string]bool {
	out := map[string]bool{}
	for _, m := range qualified.FindAllStringSubmatch(typ, -1) {
		out[m[1]] = true
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
