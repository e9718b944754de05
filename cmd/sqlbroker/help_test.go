package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// -h, --help and help print the usage on stdout and succeed, as Go's flag package does; a
// wrong command or flag is still a usage error (2), with the usage on stderr.
func TestCommand_helpExitsZero(t *testing.T) {
	for _, args := range [][]string{
		{"-h"}, {"--help"}, {"-help"}, {"help"},
		{"inspect", "-h"}, {"retention", "--help"}, {"group", "-h"}, {"group", "reset", "-h"},
		{"dead-letter", "help"}, {"dead-letter", "list", "-h"}, {"peek", "-h"},
	} {
		code, stdout, stderr := sqlbrokerCmd(t, nil, args...)
		assert.Equal(t, 0, code, "%v", args)
		assert.True(t, strings.HasPrefix(stdout, "usage:"), "%v: %q", args, stdout)
		assert.Contains(t, stdout, "sqlbroker dead-letter redrive", "%v", args)
		assert.Empty(t, stderr, "%v", args)
	}
	for _, args := range [][]string{
		{}, {"nonsense"}, {"inspect", "-no-such-flag"}, {"group"}, {"group", "nonsense"}, {"dead-letter", "nonsense"},
	} {
		code, stdout, stderr := sqlbrokerCmd(t, nil, args...)
		assert.Equal(t, 2, code, "%v", args)
		assert.Empty(t, stdout, "%v", args)
		assert.Contains(t, stderr, "usage:", "%v", args)
	}
}

// The built command's exit status, as a shell script sees it.
func TestCommand_helpExitStatusOfTheBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the command")
	}
	bin := buildCommand(t)
	out, err := exec.Command(bin, "-h").Output()
	require.NoError(t, err, "sqlbroker -h must exit 0")
	assert.True(t, strings.HasPrefix(string(out), "usage:"))
	out, err = exec.Command(bin, "help").Output()
	require.NoError(t, err, "sqlbroker help must exit 0")
	assert.True(t, strings.HasPrefix(string(out), "usage:"))
	err = exec.Command(bin, "no-such-command").Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	assert.Equal(t, 2, exit.ExitCode())
}

// buildCommand builds the sqlbroker command into a directory t removes.
func buildCommand(t *testing.T) string {
	t.Helper()
	bin := t.TempDir() + "/sqlbroker"
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Run(), "go build")
	return bin
}
