package sqlbroker_test

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// The documentation of the public packages is read by users who cannot see the code: it must
// not point at unexported names, nor at the short codes that tests carry (CONTRIBUTING.md
// lists them for contributors).
var publicPackages = []string{".", "sqlbrokerprom", "advisory", "offsets"}

// ruleCode matches a guarantee code such as S3, L3 or A6 standing alone.
var ruleCode = regexp.MustCompile(`\b[ACLMPS][0-9]{1,2}\b`)

func TestGodoc_noRuleCodesNorUnexportedNames(t *testing.T) {
	for _, dir := range publicPackages {
		t.Run(dir, func(t *testing.T) {
			fset := token.NewFileSet()
			files, err := parseDir(fset, dir)
			if err != nil {
				t.Fatal(err)
			}
			unexported := unexportedNames(files)
			p, err := doc.NewFromFiles(fset, files, "example.com/"+dir)
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range docs(p) {
				if m := ruleCode.FindString(d.text); m != "" {
					t.Errorf("%s: godoc uses the code %s: say it in words", d.where, m)
				}
				for _, w := range identWords.FindAllString(d.text, -1) {
					if unexported[w] {
						t.Errorf("%s: godoc names the unexported %s", d.where, w)
					}
				}
			}
		})
	}
}

// identWords finds words shaped like Go identifiers that a user would not take for English:
// lower camel case with an upper-case letter inside (dueSQL, wantDue).
var identWords = regexp.MustCompile(`\b[a-z][a-z0-9]*[A-Z][A-Za-z0-9]*\b`)

func parseDir(fset *token.FileSet, dir string) ([]*ast.File, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var files []*ast.File
	for _, e := range entries {
		n := e.Name()
		if !strings.HasSuffix(n, ".go") || strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, n), nil, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	return files, nil
}

// unexportedNames are the package-level names and struct fields of the package that are
// unexported.
func unexportedNames(files []*ast.File) map[string]bool {
	names := map[string]bool{}
	for _, f := range files {
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncDecl:
				names[n.Name.Name] = !n.Name.IsExported()
			case *ast.TypeSpec:
				names[n.Name.Name] = !n.Name.IsExported()
			case *ast.ValueSpec:
				for _, id := range n.Names {
					names[id.Name] = !id.IsExported()
				}
			case *ast.StructType:
				// Parameters are not collected: go doc shows them in the signature.
				for _, f := range n.Fields.List {
					for _, id := range f.Names {
						if !id.IsExported() {
							names[id.Name] = true
						}
					}
				}
			}
			return true
		})
	}
	for n, un := range names {
		if !un {
			delete(names, n)
		}
	}
	return names
}

type docText struct{ where, text string }

// docs are the texts go doc -all shows: the package's, every exported declaration's, and the
// comments inside the exported struct and interface types.
func docs(p *doc.Package) []docText {
	out := []docText{{"package " + p.Name, p.Doc}}
	values := func(vs []*doc.Value) {
		for _, v := range vs {
			out = append(out, docText{strings.Join(v.Names, ","), v.Doc})
			out = append(out, specComments(strings.Join(v.Names, ","), v.Decl)...)
		}
	}
	funcs := func(fs []*doc.Func) {
		for _, f := range fs {
			out = append(out, docText{f.Name, f.Doc})
		}
	}
	values(p.Consts)
	values(p.Vars)
	funcs(p.Funcs)
	for _, ty := range p.Types {
		out = append(out, docText{ty.Name, ty.Doc})
		out = append(out, specComments(ty.Name, ty.Decl)...)
		values(ty.Consts)
		values(ty.Vars)
		funcs(ty.Funcs)
		for _, m := range ty.Methods {
			out = append(out, docText{ty.Name + "." + m.Name, m.Doc})
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].where < out[j].where })
	return out
}

// specComments are the comments inside a declaration that go doc prints with it: those of
// exported fields and methods of a struct or interface, and of the values of a const block.
func specComments(where string, decl *ast.GenDecl) []docText {
	var out []docText
	ast.Inspect(decl, func(n ast.Node) bool {
		if f, ok := n.(*ast.Field); ok {
			exported := len(f.Names) == 0 // an embedded field
			for _, id := range f.Names {
				exported = exported || id.IsExported()
			}
			if !exported {
				return false
			}
			for _, c := range []*ast.CommentGroup{f.Doc, f.Comment} {
				if c != nil {
					out = append(out, docText{where + " field", c.Text()})
				}
			}
		}
		if v, ok := n.(*ast.ValueSpec); ok {
			for _, c := range []*ast.CommentGroup{v.Doc, v.Comment} {
				if c != nil {
					out = append(out, docText{where, c.Text()})
				}
			}
		}
		return true
	})
	return out
}
