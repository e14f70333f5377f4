package docscheck_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/docscheck"
)

// knownSkips are blocks in pages this test cannot mark with <!-- docscheck:skip -->
// (owned elsewhere), keyed by file and a string the block contains. Prefer the marker.
var knownSkips = map[string]string{
	"docs/relay.md\x00kadm.NewClient": "kadm (github.com/twmb/franz-go/pkg/kadm) is not a dependency of onceflow",
}

// moduleRoot is the folder holding go.mod, two levels up from this package.
func moduleRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("no go.mod at %s: %v", root, err)
	}
	return root
}

// markdownFiles are README.md and docs/*.md, relative to root.
func markdownFiles(t *testing.T, root string) []string {
	t.Helper()
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := []string{"README.md"}
	for _, d := range docs {
		files = append(files, filepath.ToSlash(strings.TrimPrefix(d, root+string(filepath.Separator))))
	}
	sort.Strings(files[1:])
	return files
}

// Every ```go block of README.md and docs/*.md compiles (see package docscheck for how
// fragments are completed, and CONTRIBUTING.md for the conventions).
func TestGoBlocksCompile(t *testing.T) {
	root := moduleRoot(t)
	tmp := t.TempDir()
	overlay := map[string]string{}
	var pkgs []string
	blocks := 0
	for _, file := range markdownFiles(t, root) {
		md, err := os.ReadFile(filepath.Join(root, file))
		if err != nil {
			t.Fatal(err)
		}
		bs, err := docscheck.Blocks(file, string(md))
		if err != nil {
			t.Fatal(err)
		}
		for i, b := range bs {
			for key, reason := range knownSkips {
				f, needle, _ := strings.Cut(key, "\x00")
				if f == file && strings.Contains(b.Code, needle) && b.Skip == "" {
					bs[i].Skip = reason
				}
			}
			if bs[i].Skip != "" {
				t.Logf("%s:%d: skipped: %s", file, b.Line, bs[i].Skip)
			}
		}
		pkg := docscheck.PackageName(file)
		files, err := docscheck.Package(pkg, bs)
		if err != nil {
			t.Error(err)
			continue
		}
		if len(files) == 0 {
			continue
		}
		blocks += len(files)
		dir := filepath.Join(root, "internal", "docscheck", "generated", pkg)
		for _, f := range files {
			src := filepath.Join(tmp, pkg+"_"+f.Name)
			if err := os.WriteFile(src, []byte(f.Source), 0o644); err != nil {
				t.Fatal(err)
			}
			overlay[filepath.Join(dir, f.Name)] = src
		}
		pkgs = append(pkgs, "./internal/docscheck/generated/"+pkg)
	}
	if t.Failed() || len(pkgs) == 0 {
		return
	}
	ov, err := json.Marshal(map[string]any{"Replace": overlay})
	if err != nil {
		t.Fatal(err)
	}
	ovFile := filepath.Join(tmp, "overlay.json")
	if err := os.WriteFile(ovFile, ov, 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"build", "-overlay", ovFile}
	if raceBuild() {
		args = append(args, "-race") // reuse the race-built packages `go test -race` just compiled
	}
	cmd := exec.Command(goTool(), append(args, pkgs...)...)
	cmd.Dir = root
	// Offline and without touching go.mod: every import must already be a dependency.
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=readonly", "GOPROXY=off", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("Go code in the documentation does not compile (positions are in the Markdown files; conventions in CONTRIBUTING.md, \"Code in the documentation\"):\n%s", out)
	}
	t.Logf("%d Go blocks compile", blocks)
}

// goTool is the go command that built this test, so the blocks compile with the same version.
func goTool() string {
	if goroot := os.Getenv("GOROOT"); goroot != "" {
		if p := filepath.Join(goroot, "bin", "go"); fileExists(p) {
			return p
		}
	}
	if out, err := exec.Command("go", "env", "GOROOT").Output(); err == nil {
		if p := filepath.Join(strings.TrimSpace(string(out)), "bin", "go"); fileExists(p) {
			return p
		}
	}
	return "go"
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// raceBuild reports whether this test binary was built with -race.
func raceBuild() bool {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, s := range info.Settings {
			if s.Key == "-race" {
				return s.Value == "true"
			}
		}
	}
	return false
}

// Every block marked <!-- docscheck:quote FILE REGION --> is that region of FILE, byte for
// byte, so the code the README shows is the code that compiles and runs.
func TestQuotedBlocks(t *testing.T) {
	root := moduleRoot(t)
	quoted := 0
	for _, file := range markdownFiles(t, root) {
		md, err := os.ReadFile(filepath.Join(root, file))
		if err != nil {
			t.Fatal(err)
		}
		bs, err := docscheck.Blocks(file, string(md))
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range bs {
			if b.QuoteFile == "" {
				continue
			}
			quoted++
			src, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(b.QuoteFile)))
			if err != nil {
				t.Errorf("%s:%d: quoted file: %v", file, b.Line, err)
				continue
			}
			region, err := docscheck.Region(string(src), b.QuoteRegion)
			if err != nil {
				t.Errorf("%s:%d: %s: %v", file, b.Line, b.QuoteFile, err)
				continue
			}
			if b.Code != region {
				t.Errorf("%s:%d: the block differs from region %q of %s; copy the region into the block.\n%s",
					file, b.Line, b.QuoteRegion, b.QuoteFile, firstDifference(b.Code, region))
			}
		}
	}
	if quoted == 0 {
		t.Error("no quoted block found; README.md quotes its quickstart from internal/docscheck/readme_test.go")
	}
}

// firstDifference describes the first line where got and want differ.
func firstDifference(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < len(g) || i < len(w); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl {
			return fmt.Sprintf("line %d of the block:\n  block:  %q\n  region: %q", i+1, gl, wl)
		}
	}
	return "(same lines, different line endings)"
}
